"""Triton kernels against their torch references: time, bandwidth, exactness."""
