"""The tensor-parallel group of this process: rank, size and the collectives the layers use.

One process is one rank. With size 1 every collective is the identity, so the models run unchanged
in a single process with no torch.distributed set-up.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_RANK = 0
_WORLD = 1


def init_tensor_parallel(rank: int, world_size: int, init_method: str | None, backend: str,
                         timeout_s: float = 120.0) -> None:
    """Join the TP group: `backend` is "nccl" on GPUs, "gloo" on CPUs (or GPUs sharing one device)."""
    global _RANK, _WORLD
    _RANK, _WORLD = rank, world_size
    if world_size == 1:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def destroy_tensor_parallel() -> None:
    global _RANK, _WORLD
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _WORLD = 0, 1


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _WORLD


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _WORLD == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _WORLD == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_WORLD)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def all_reduce_min(value: int) -> int:
    """The smallest `value` across ranks (the KV block count every rank can hold)."""
    if _WORLD == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
