"""Triton kernels of the model layers (RMSNorm, q/k norm + rotary, SiLU-and-mul), their torch references,
and the dispatch between them. The KV-cache kernels (slot mapping, cache write, paged attention) stay in
kvcore/kernels/."""
