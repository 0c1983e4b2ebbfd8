"""The model-parallel groups of this process: its tensor-parallel group, its pipeline stage, and the
collectives and stage-to-stage sends the layers and the runner use.

An engine has pipeline_parallel_size x tensor_parallel_size ranks, rank = pp_rank * tp + tp_rank. The
ranks of one stage form a TP group (all-reduce, all-gather); rank (s, t) sends its stage's output (the
hidden state and the residual, replicated over the TP ranks after the all-reduce) to rank (s + 1, t), so
one activation crosses each stage boundary per TP rank. With one rank every collective is the identity,
so the models run unchanged in a single process with no torch.distributed set-up.

The collectives and the sends run on groups of their own with `collective_timeout_s` (shorter than the
driver's step timeout), apart from the rendezvous's longer timeout: when one rank fails a step before a
collective, or a stage dies mid-send, the others do not wait for it for ever (gloo raises at the timeout;
NCCL's watchdog ends the process). A failed collective or send leaves the groups out of step (the ranks
no longer agree which operation is which), so it raises CollectiveError and every later one refuses at
once: the groups must be rebuilt.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from actors.errors import CollectiveError

_RANK = 0  # within the TP group
_WORLD = 1  # TP size
_GROUP: dist.ProcessGroup | None = None  # this stage's TP group
_PP_RANK = 0
_PP_SIZE = 1
_PP_GROUP: dist.ProcessGroup | None = None  # this TP rank's column across the stages
_P2P_TIMEOUT = datetime.timedelta(seconds=60)
_PENDING_SENDS: list[dist.Work] = []  # the last send's works (its tensors must live until they finish)
_SENDING: list[torch.Tensor] = []  # the tensors those works read
_P2P_VIA_HOST = False  # gloo sends and receives host tensors only: device tensors go through a host copy
_BROKEN: str | None = None  # why the groups are out of step, once a collective or send failed
_RENDEZVOUS: dist.TCPStore | None = None  # the groups' store, hosted by rank 0 (open_rendezvous)


def open_rendezvous(world: int, timeout_s: float = 120.0) -> int:
    """Rank 0: host the groups' rendezvous store on a port the OS assigns as it binds, and return that
    port; the executor hands `tcp://<rank 0's node>:<port>` to every rank's init_model_parallel.

    A port found free first and bound later (torch's own tcp:// rendezvous on rank 0) leaves a window in
    which another process on the host takes it, and the group then fails with EADDRINUSE; under load
    (two test suites, a busy node) that happens. A port bound at once has no such window. The store
    listens on every interface, as torch's does, so the other nodes' ranks reach it."""
    global _RENDEZVOUS
    _RENDEZVOUS = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return int(_RENDEZVOUS.port)


def _hosted_store(rank: int, init_method: str | None) -> dist.Store | None:
    """Rank 0's own store when init_method names it (open_rendezvous), else None: torch then makes the
    store from init_method. The prefix is the one torch's rendezvous puts on the store it makes, so
    the ranks that join through init_method find the same keys."""
    if rank != 0 or _RENDEZVOUS is None or init_method is None:
        return None
    if not init_method.startswith("tcp://") or not init_method.endswith(f":{_RENDEZVOUS.port}"):
        return None
    return dist.PrefixStore("default_pg", _RENDEZVOUS)


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str | None,
    backend: str,
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
) -> None:
    """Join a TP group of `world_size` ranks with no pipeline stages (see init_model_parallel)."""
    init_model_parallel(rank, world_size, 1, init_method, backend, timeout_s, collective_timeout_s)


def init_model_parallel(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str | None,
    backend: str,
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
) -> None:
    """Join the engine's groups as global rank `rank` of pp_size x tp_size: `backend` is "nccl" on GPUs,
    "gloo" on CPUs (or GPUs sharing one device). `timeout_s` bounds the rendezvous,
    `collective_timeout_s` (default: timeout_s) every collective and every stage-to-stage transfer."""
    global _RANK, _WORLD, _GROUP, _PP_RANK, _PP_SIZE, _PP_GROUP, _P2P_TIMEOUT, _BROKEN, _P2P_VIA_HOST
    world = tp_size * pp_size
    _P2P_VIA_HOST = backend == "gloo"
    if not 0 <= rank < world:
        raise ValueError(f"init_model_parallel: rank={rank} must be in [0, {world}) (pp={pp_size} x tp={tp_size})")
    _RANK, _WORLD, _GROUP, _BROKEN = rank % tp_size, tp_size, None, None
    _PP_RANK, _PP_SIZE, _PP_GROUP = rank // tp_size, pp_size, None
    _PENDING_SENDS.clear()
    op_timeout = datetime.timedelta(seconds=collective_timeout_s or timeout_s)
    _P2P_TIMEOUT = op_timeout
    if world == 1:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    store = _hosted_store(rank, init_method)
    dist.init_process_group(
        backend=backend,
        init_method=None if store is not None else init_method,
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # Every rank creates every group, in one order (torch.distributed's rule), and keeps its own.
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), backend=backend, timeout=op_timeout)
        if stage == _PP_RANK:
            _GROUP = group
    if pp_size > 1:
        for tp_rank in range(tp_size):
            column = [stage * tp_size + tp_rank for stage in range(pp_size)]
            group = dist.new_group(column, backend=backend, timeout=op_timeout)
            if tp_rank == _RANK:
                _PP_GROUP = group


def destroy_tensor_parallel() -> None:
    global _RANK, _WORLD, _GROUP, _PP_RANK, _PP_SIZE, _PP_GROUP, _BROKEN, _RENDEZVOUS
    _PENDING_SENDS.clear()
    _SENDING.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    _RENDEZVOUS = None
    _RANK, _WORLD, _GROUP, _BROKEN = 0, 1, None, None
    _PP_RANK, _PP_SIZE, _PP_GROUP = 0, 1, None


def _failed(op: str, e: BaseException) -> CollectiveError:
    global _BROKEN
    first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    where = f"stage {_PP_RANK} tensor-parallel rank {_RANK}" if _PP_SIZE > 1 else f"tensor-parallel rank {_RANK}"
    _BROKEN = f"{op} failed on {where}: {first}"
    return CollectiveError(_BROKEN)


def _check_group() -> None:
    if _BROKEN is not None:
        raise CollectiveError(
            f"the model-parallel groups are out of step since an earlier collective failed "
            f"({_BROKEN}); it must be rebuilt"
        )


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _WORLD


def pp_rank() -> int:
    return _PP_RANK


def pp_size() -> int:
    return _PP_SIZE


def is_first_stage() -> bool:
    return _PP_RANK == 0


def is_last_stage() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """Send `tensors` (contiguous, in order) to the same TP rank of the next stage, without waiting for
    them to arrive; the previous send is finished first (within the timeout), so at most one step's
    activations are in transit and their buffers may be reused after the next send."""
    if _PP_SIZE == 1 or is_last_stage():
        raise RuntimeError(f"send_to_next_stage: stage {_PP_RANK} of {_PP_SIZE} has no next stage")
    _check_group()
    wait_for_sends()
    dst = (_PP_RANK + 1) * _WORLD + _RANK
    try:
        for tag, t in enumerate(tensors):
            t = t.cpu() if _P2P_VIA_HOST and t.device.type != "cpu" else t.contiguous()
            _SENDING.append(t)
            work = dist.isend(t, dst=dst, group=_PP_GROUP, tag=tag)
            if work is not None:  # None only when this rank is not in the group, which it always is
                _PENDING_SENDS.append(work)
    except Exception as e:  # as in all_reduce
        raise _failed("send to the next stage", e) from e


def wait_for_sends() -> None:
    """Finish the sends in flight (their tensors may then be reused); a receiver that died or stalls
    fails it at the timeout."""
    try:
        while _PENDING_SENDS:
            _PENDING_SENDS[0].wait(_P2P_TIMEOUT)
            _PENDING_SENDS.pop(0)
        _SENDING.clear()
    except Exception as e:  # as in all_reduce
        _PENDING_SENDS.clear()
        _SENDING.clear()
        raise _failed("send to the next stage", e) from e


def recv_from_prev_stage(buffers: list[torch.Tensor]) -> None:
    """Fill `buffers` (contiguous, in the sender's order) from the same TP rank of the previous stage;
    a sender that died or stalls fails it at the timeout, so no stage waits for ever."""
    if _PP_SIZE == 1 or is_first_stage():
        raise RuntimeError(f"recv_from_prev_stage: stage {_PP_RANK} of {_PP_SIZE} has no previous stage")
    _check_group()
    src = (_PP_RANK - 1) * _WORLD + _RANK
    staged = [torch.empty(b.shape, dtype=b.dtype) if _P2P_VIA_HOST and b.device.type != "cpu" else b for b in buffers]
    try:
        works = [dist.irecv(b, src=src, group=_PP_GROUP, tag=tag) for tag, b in enumerate(staged)]
        for w in works:
            if w is not None:
                w.wait(_P2P_TIMEOUT)
    except Exception as e:  # as in all_reduce
        raise _failed("receive from the previous stage", e) from e
    for b, h in zip(buffers, staged, strict=True):
        if h is not b:
            b.copy_(h)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _WORLD == 1:
        return x
    _check_group()
    try:
        dist.all_reduce(x, group=_GROUP)
    except Exception as e:  # gloo's timeout is a RuntimeError, a lost peer DistBackendError
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
    except Exception as e:  # as in all_reduce
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
    except Exception as e:  # as in all_reduce
        raise _failed("all_reduce(min)", e) from e
    return int(t.item())
