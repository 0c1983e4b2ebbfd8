"""kvcore: engine-agnostic KV-cache machinery (specs, block pool, manager, scheduler, block tables,
kernels). Imports torch, triton and numpy, never ray."""

from kvcore.request import Request, RequestStatus, SamplingParams

__all__ = ["Request", "RequestStatus", "SamplingParams"]
