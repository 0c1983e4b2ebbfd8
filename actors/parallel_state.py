"""The tensor-parallel group of this process: rank, size and the collectives the layers use.

One process is one rank. With size 1 every collective is the identity, so the models run unchanged
in a single process with no torch.distributed set-up.

The collectives run on a group of their own with `collective_timeout_s` (shorter than the driver's step
timeout), apart from the rendezvous's longer timeout: when one rank fails a step before a collective,
the others do not wait for it for ever (gloo raises at the timeout; NCCL's watchdog ends the process).
A failed collective leaves the group out of step (the ranks no longer agree which operation is which),
so it raises CollectiveError and every later collective refuses at once: the group must be rebuilt.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from actors.errors import CollectiveError

_RANK = 0
_WORLD = 1
_GROUP: dist.ProcessGroup | None = None
_BROKEN: str | None = None  # why the group is out of step, once a collective failed


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str | None,
    backend: str,
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
) -> None:
    """Join the TP group: `backend` is "nccl" on GPUs, "gloo" on CPUs (or GPUs sharing one device).
    `timeout_s` bounds the rendezvous, `collective_timeout_s` (default: timeout_s) every collective."""
    global _RANK, _WORLD, _GROUP, _BROKEN
    _RANK, _WORLD, _GROUP, _BROKEN = rank, world_size, None, None
    if world_size == 1:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _GROUP = dist.new_group(
        list(range(world_size)), backend=backend, timeout=datetime.timedelta(seconds=collective_timeout_s or timeout_s)
    )


def destroy_tensor_parallel() -> None:
    global _RANK, _WORLD, _GROUP, _BROKEN
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _WORLD, _GROUP, _BROKEN = 0, 1, None, None


def _failed(op: str, e: BaseException) -> CollectiveError:
    global _BROKEN
    _BROKEN = f"{op} failed on tensor-parallel rank {_RANK}: {str(e).strip().splitlines()[0] if str(e) else e!r}"
    return CollectiveError(_BROKEN)


def _check_group() -> None:
    if _BROKEN is not None:
        raise CollectiveError(
            f"the tensor-parallel group is out of step since an earlier collective failed "
            f"({_BROKEN}); it must be rebuilt"
        )


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _WORLD


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _WORLD == 1:
        return x
    _check_group()
    try:
        dist.all_reduce(x, group=_GROUP)
    except Exception as e:  # noqa: BLE001 - gloo's timeout is a RuntimeError, a lost peer DistBackendError
        raise _failed("all_reduce", e) from e
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _WORLD == 1:
        return x
    _check_group()
    parts = [torch.empty_like(x) for _ in range(_WORLD)]
    try:
        dist.all_gather(parts, x.contiguous(), group=_GROUP)
    except Exception as e:  # noqa: BLE001 - as in all_reduce
        raise _failed("all_gather", e) from e
    return torch.cat(parts, dim=dim)


def all_reduce_min(value: int) -> int:
    """The smallest `value` across ranks (the KV block count every rank can hold)."""
    if _WORLD == 1:
        return value
    _check_group()
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_GROUP)
    except Exception as e:  # noqa: BLE001 - as in all_reduce
        raise _failed("all_reduce(min)", e) from e
    return int(t.item())
