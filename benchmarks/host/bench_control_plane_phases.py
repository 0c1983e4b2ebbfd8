"""Where the shm transport's per-step control-plane time goes, without Ray: the real ShmTransport
(driver side) and the real ShmWorkerLoop over NoopWorkers in forked processes, on the real rings, with
the step loop of benchmarks/host/bench_control_plane.py (schedule -> broadcast -> every rank's answer -> update).

Every phase is stamped with time.perf_counter_ns (CLOCK_MONOTONIC, one clock for all processes) by
wrappers around the transport's own objects, so the code timed is the code that runs under Ray:

  schedule        Scheduler.schedule()
  encode          broadcast() entry -> the ring write starts (dumps(so) and the deadline)
  ring write      the copy into the slot, the fence, the counter (ShmRing.write less its doorbells)
  doorbells       the writer's doorbell writes
  deliver         the counter published -> the rank's recv() returned (its wake-up and the copy out)
  decode          the rank's recv() returned -> execute_model starts (pickle.loads)
  worker step     NoopWorker.execute_model
  answer encode   execute_model returned -> the answer's write starts (the (ok, out) tuple, dumps)
  answer write    the answer ring write, its doorbell included
  answer deliver  the answer written -> the driver's try_recv returned it
  answer decode   -> broadcast() returned (pickle.loads, the collect loop's exit)
  update          Scheduler.update_from_output
Without --phases only the step (schedule -> update) is timed, with no wrappers.

  python -m benchmarks.host.bench_control_plane_phases [--tp 1 2] [--steps 2000] [--spin-s 0.001] [--phases]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from multiprocessing import get_context, shared_memory
from typing import Any

import zmq

import actors.transport.shm_reader as shm_worker
from actors.config.engine import EngineConfig
from actors.driver.engine_core import EngineCore
from actors.executor.base import Executor
from actors.transport.channels import ChannelSpec, RingReceiver, RingSender
from actors.transport.shm import BROADCAST_SLOT_BYTES, BROADCAST_SLOTS, REPLY_SLOT_BYTES, REPLY_SLOTS, ShmTransport
from actors.transport.shm_ring import ShmRing
from actors.worker.noop import NoopWorker
from kvcore.request import Request, SamplingParams

# Stamps per step: the driver's, then each rank's.
DRIVER = ("t0", "scheduled", "write_start", "bells_start", "bells_end", "answer_seen", "returned", "updated")
RANK = ("recv_done", "step_start", "step_end", "send_start", "send_end")


class Stamps:
    """An int64 table [step, column] in shared memory that every process writes its own columns of."""

    def __init__(self, steps: int, tp: int, shm: shared_memory.SharedMemory | None = None) -> None:
        self.cols = len(DRIVER) + tp * len(RANK)
        self.shm = shm or shared_memory.SharedMemory(create=True, size=8 * steps * self.cols)
        assert self.shm.buf is not None
        self.table = self.shm.buf.cast("q")
        self.step = 0  # the row being written, in each process (every process sees every step)
        self.t_recv = 0  # a rank's last receive, written into its row once the step is decoded

    def put(self, col: int) -> None:
        self.table[self.step * self.cols + col] = time.perf_counter_ns()

    def get(self, step: int, col: int) -> int:
        return self.table[step * self.cols + col]

    def rank_col(self, rank: int, name: str) -> int:
        return len(DRIVER) + rank * len(RANK) + RANK.index(name)


class _Local(Executor):
    """The set-up calls go to one in-process NoopWorker; the steps to the transport."""

    def __init__(self, config: EngineConfig, transport: ShmTransport) -> None:
        self.worker = NoopWorker(config, 0, 1, None)
        self.transport = transport

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.transport.broadcast(scheduler_output)

    def shutdown(self) -> None:
        pass


def driver_transport(tp: int, spin_s: float, timeout_s: float) -> tuple[ShmTransport, list[ShmRing]]:
    """A ShmTransport over rings to `tp` local ranks, as ShmTransport._attach builds it (less Ray)."""
    t = object.__new__(ShmTransport)
    t.workers, t.step_timeout_s, t.failure, t.spin_s = [None] * tp, timeout_s, None, spin_s
    ring = ShmRing.create(tp, BROADCAST_SLOTS, BROADCAST_SLOT_BYTES)
    replies = [ShmRing.create(1, REPLY_SLOTS, REPLY_SLOT_BYTES) for _ in range(tp)]
    t._ring, t._senders, t._owned_rings, t._remote_ranks = ring, [RingSender(ring)], [ring, *replies], []
    chans = [RingReceiver(r, 0) for r in replies]
    t._replies = list(chans)
    t._poller = zmq.Poller()
    for chan in chans:
        t._poller.register(chan.pollable(), zmq.POLLIN)
    return t, replies


def rank_main(config: EngineConfig, rank: int, spec: Any, stamps_name: str, steps: int, tp: int, on: bool) -> None:
    worker = NoopWorker(config, rank, tp, None)
    if on:
        stamps = Stamps(steps, tp, shared_memory.SharedMemory(name=stamps_name))
        wrap_rank(worker, stamps, rank)
    loop = shm_worker.ShmWorkerLoop(worker, spec)
    loop._thread.join()
    os._exit(0)


def wrap_rank(worker: NoopWorker, stamps: Stamps, rank: int) -> None:
    col = {name: stamps.rank_col(rank, name) for name in RANK}
    real_step, real_recv, real_send = worker.execute_model, shm_worker.open_receiver, shm_worker.open_sender

    def execute_model(so: Any) -> Any:
        stamps.step = so.step_id
        stamps.put(col["step_start"])
        out = real_step(so)
        stamps.put(col["step_end"])
        return out

    def open_receiver(spec: ChannelSpec) -> Any:
        end = real_recv(spec)
        recv = end.recv

        def stamped(*args: Any) -> Any:
            data = recv(*args)
            stamps.t_recv = time.perf_counter_ns()
            return data

        end.recv = stamped  # type: ignore[assignment,method-assign]
        return end

    def open_sender(spec: ChannelSpec) -> Any:
        end = real_send(spec)
        send = end.send

        def stamped(data: bytes, timeout_s: float) -> None:
            # The step's row is known only once the step was decoded: put the receive stamp now.
            stamps.table[stamps.step * stamps.cols + col["recv_done"]] = stamps.t_recv
            stamps.put(col["send_start"])
            send(data, timeout_s)
            stamps.put(col["send_end"])

        end.send = stamped  # type: ignore[method-assign]
        return end

    worker.execute_model = execute_model  # type: ignore[method-assign]
    shm_worker.open_receiver, shm_worker.open_sender = open_receiver, open_sender


def wrap_driver(t: ShmTransport, stamps: Stamps) -> None:
    ring = t._ring
    assert ring is not None
    bells, send = ring._ring_bells, t._senders[0].send

    def ring_bells(*args: Any, **kwargs: Any) -> None:
        stamps.put(DRIVER.index("bells_start"))
        bells(*args, **kwargs)
        stamps.put(DRIVER.index("bells_end"))

    def stamped_send(data: bytes, timeout_s: float) -> None:
        stamps.put(DRIVER.index("write_start"))
        send(data, timeout_s)

    ring._ring_bells = ring_bells  # type: ignore[method-assign]
    t._senders[0].send = stamped_send  # type: ignore[method-assign]
    for chan in t._replies:
        assert chan is not None
        try_recv = chan.try_recv

        def stamped_recv(timeout_s: float, try_recv: Any = try_recv) -> Any:
            data = try_recv(timeout_s)
            if data is not None:
                stamps.put(DRIVER.index("answer_seen"))
            return data

        chan.try_recv = stamped_recv  # type: ignore[method-assign]


def config_for(tp: int, num_reqs: int, device: str) -> EngineConfig:
    return EngineConfig().replace(
        tensor_parallel_size=tp,
        transport="shm",
        device=device,
        num_gpu_blocks=8192,
        max_num_seqs=max(num_reqs, 1),
        max_model_len=4096,
        max_num_batched_tokens=4096,
        step_timeout_s=60,
    )


def run(tp: int, steps: int, num_reqs: int, spin_s: float, phases: bool, device: str) -> dict[str, float]:
    warmup = 20
    config = config_for(tp, num_reqs, device)
    stamps = Stamps(warmup + steps + 2, tp)
    t, replies = driver_transport(tp, spin_s, 60.0)
    ring = t._ring
    assert ring is not None
    procs = []
    for rank in range(tp):
        steps_spec = ChannelSpec(ring=ring.handle, reader=rank, spin_s=spin_s)
        spec = shm_worker.ShmLoopSpec(rank, steps_spec, ChannelSpec(ring=replies[rank].handle), 60.0)
        args = (config, rank, spec, stamps.shm.name, warmup + steps + 2, tp, phases)
        procs.append(get_context("fork").Process(target=rank_main, args=args, daemon=True))
        procs[-1].start()
    try:
        return _measure(config, t, stamps, tp, warmup, steps, num_reqs, phases)
    finally:
        for r in t._owned_rings:
            r.close()
        for p in procs:
            p.join(10)
        stamps.table.release()
        stamps.shm.close()
        stamps.shm.unlink()


def _measure(
    config: EngineConfig, t: ShmTransport, stamps: Stamps, tp: int, warmup: int, steps: int, num_reqs: int, on: bool
) -> dict[str, float]:
    engine = EngineCore(config, _Local(config, t))
    for i in range(num_reqs):
        engine.add_request(Request(f"r{i}", list(range(1, 65)), SamplingParams(max_tokens=30000, ignore_eos=True)))
    for _ in range(warmup):
        engine.step()
    if on:
        wrap_driver(t, stamps)
    sched, ex, update = engine.scheduler.schedule, engine.executor.execute_model, engine.scheduler.update_from_output
    col = {name: DRIVER.index(name) for name in DRIVER}
    rows, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        so = sched()
        stamps.step = so.step_id
        stamps.table[so.step_id * stamps.cols + col["t0"]] = t0
        stamps.put(col["scheduled"])
        out = ex(so)
        stamps.put(col["returned"])
        update(so, out)
        stamps.put(col["updated"])
        times.append(time.perf_counter_ns() - t0)
        rows.append(so.step_id)
    result = {"step_us": statistics.median(times) / 1e3, "p90_step_us": sorted(times)[int(0.9 * steps)] / 1e3}
    if on:
        result.update(breakdown(stamps, rows, tp))
    return result


def breakdown(stamps: Stamps, rows: list[int], tp: int) -> dict[str, float]:
    """The median of each phase over the measured steps, in microseconds (rank phases: rank 0's)."""

    def d(a: str, b: str, rank: int = -1) -> list[float]:
        out = []
        for s in rows:
            ta = stamps.get(s, DRIVER.index(a)) if a in DRIVER else stamps.get(s, stamps.rank_col(rank, a))
            tb = stamps.get(s, DRIVER.index(b)) if b in DRIVER else stamps.get(s, stamps.rank_col(rank, b))
            out.append((tb - ta) / 1e3)
        return out

    med = statistics.median
    phases = {
        "schedule": med(d("t0", "scheduled")),
        "encode": med(d("scheduled", "write_start")),
        "ring write": med(d("write_start", "bells_start")),
        "doorbells": med(d("bells_start", "bells_end")),
    }
    for rank in range(tp):
        phases[f"deliver r{rank}"] = med(d("bells_start", "recv_done", rank))
    phases.update(
        {
            "decode": med(d("recv_done", "step_start", 0)),
            "worker step": med(d("step_start", "step_end", 0)),
            "answer encode": med(d("step_end", "send_start", 0)),
            "answer write": med(d("send_start", "send_end", 0)),
            f"answer deliver r{tp - 1}": med(d("send_end", "answer_seen", tp - 1)),
            "answer decode": med(d("answer_seen", "returned")),
            "update": med(d("returned", "updated")),
            "broadcast total": med(d("scheduled", "returned")),
        }
    )
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--num-reqs", type=int, default=32)
    ap.add_argument("--spin-s", type=float, default=1e-3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the GPU host's config (async)")
    ap.add_argument("--phases", action="store_true")
    args = ap.parse_args()
    for tp in args.tp:
        r = run(tp, args.steps, args.num_reqs, args.spin_s, args.phases, args.device)
        print(f"tp={tp} step median {r.pop('step_us'):8.1f} us  p90 {r.pop('p90_step_us'):8.1f} us", flush=True)
        for name, us in r.items():
            print(f"    {name:18s} {us:8.1f} us")


if __name__ == "__main__":
    main()
