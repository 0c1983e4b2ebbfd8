"""Sampling and logprobs on the device: the one-launch sampler kernel, its torch reference, its inputs and
penalty state, and the logprobs kernels and bookkeeping."""
