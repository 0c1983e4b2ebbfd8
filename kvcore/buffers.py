"""CpuGpuBuffer: a host tensor paired with a device tensor of the same shape.

The host side is the one the CPU writes (through the numpy view `.np`, which is far cheaper per
element than torch indexing); the device side is what kernels read. The host side is pinned when a
GPU is present so that `copy_to_gpu` is a true asynchronous DMA that overlaps the CPU work after it.
"""

from __future__ import annotations

import numpy as np
import torch


def pinning_available() -> bool:
    """Pinning needs a CUDA driver; asking for it on a CPU-only machine raises inside torch."""
    return torch.cuda.is_available()


class CpuGpuBuffer:
    """`.cpu` (pinned when asked for and CUDA exists), `.gpu` (on `device`), `.np` (view of `.cpu`).

    When `device` is the CPU, `.gpu` is still a separate tensor, so code written against this class
    exercises the same copy path in CPU tests as on the GPU.
    """

    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device | str, pin_memory: bool) -> None:
        if not size:
            raise ValueError("CpuGpuBuffer: size must name at least one dimension")
        for i, dim in enumerate(size):
            if not isinstance(dim, (int, np.integer)) or dim < 0:
                raise ValueError(f"CpuGpuBuffer: size[{i}] must be a non-negative int, got {dim!r}")
        self.device = torch.device(device)
        self.pinned = bool(pin_memory) and pinning_available()
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=self.pinned)
        self.gpu = torch.zeros(*size, dtype=dtype, device=self.device)
        self.np = self.cpu.numpy()

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copies the first `n` rows (all when None) host -> device without blocking the host;
        returns the device slice that was written."""
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        self._check_n(n)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)

    def _check_n(self, n: int) -> None:
        if not 0 <= n <= self.cpu.shape[0]:
            raise ValueError(f"CpuGpuBuffer: n must be in [0, {self.cpu.shape[0]}], got {n}")
