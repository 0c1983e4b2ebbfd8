"""Block-table benchmarks: the slot-mapping kernel and the block-table commit, full rows vs delta.

Slot mapping: one MultiGroupBlockTable group (block 16, max_model_len 200,000 -> 12,500 blocks a
row, 256 rows, 8,192-token buffer), batches (requests x tokens each) 1x1, 256x1, 16x512, 4x2048,
1x8192; plus 256x1 with two groups in the same single launch. Timed with triton.testing.do_bench.
Commit: 256 running requests in a 256 x 12,500 table; each step appends one block to every row
(the worst decode step; usually only 1 in 16 rows gains a block) and, in a second case, also moves
four long rows (condense after finishes). Timed per step two ways, in separate series: "wall", from
a CUDA event recorded on an idle GPU before the commit call to one after it, so the host work of
building the delta and launching counts too; and "stream", with the GPU kept busy by a sleep kernel
queued first, so the events see only the device time the commit adds to the step's stream (what a
step pays once async scheduling overlaps the host work with the previous step). The host time of
the call is reported as well.
Every figure is checked against the torch reference / the CPU table before it is reported.

  python -m benchmarks.kernels.bench_block_table            # GPU; appends to results/bench_block_table.jsonl
  python -m benchmarks.kernels.bench_block_table --smoke    # CPU, tiny sizes, Triton interpreter
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

from benchmarks.common import record
from kvcore.block_table import BlockTable, MultiGroupBlockTable
from kvcore.kernels.slot_mapping import slot_mapping_ref

SCRIPT = "bench_block_table"
SLOT_CASES = [(1, 1), (256, 1), (16, 512), (4, 2048), (1, 8192)]


def sizes(smoke: bool) -> dict:
    if smoke:
        return dict(reqs=16, model_len=4096, tokens=512, steps=3, cases=[(1, 1), (16, 1), (4, 64), (1, 256)])
    return dict(reqs=256, model_len=200_000, tokens=8192, steps=200, cases=SLOT_CASES)


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median microseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
    fn()
    samples = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


def fill_rows(table: MultiGroupBlockTable, rng: np.random.Generator, num_reqs: int) -> None:
    """Rows as a busy engine leaves them: random lengths, blocks scattered over a big pool."""
    for bt in table.block_tables:
        lens = rng.integers(1, bt.max_num_blocks_per_req + 1, size=num_reqs)
        for r, n in enumerate(lens):
            bt.add_row(rng.integers(1, 1 << 22, size=int(n)).tolist(), r)


def make_batch(num_reqs: int, q: int, bt: BlockTable, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's last q positions of its current context (decode: q = 1)."""
    pos = []
    for r in range(num_reqs):
        ctx = max(q, int(bt.num_blocks_per_row[r]) * bt.block_size)
        pos.extend(range(ctx - q, ctx))
    qsl = torch.arange(0, (num_reqs + 1) * q, q, dtype=torch.int32)
    return qsl.to(device), torch.tensor(pos, dtype=torch.int64).to(device)


def bench_slot_mapping(device: torch.device, sz: dict) -> dict[str, float]:
    results = {}
    for groups in ([16], [16, 32]):
        mg = MultiGroupBlockTable(sz["reqs"], sz["model_len"], sz["tokens"], True, device, groups)
        fill_rows(mg, np.random.default_rng(0), sz["reqs"])
        mg.commit_block_table(sz["reqs"])
        cases = sz["cases"] if len(groups) == 1 else [c for c in sz["cases"] if c[1] == 1][-1:]
        for num_reqs, q in cases:
            qsl, pos = make_batch(num_reqs, q, mg[0], device)
            mg.compute_slot_mapping(num_reqs, qsl, pos)
            for bt in mg.block_tables:  # correctness before timing
                n = pos.numel()  # the step's entries: what the launch writes
                ref = slot_mapping_ref(bt.block_table.gpu, bt.block_size, qsl, pos, num_reqs, n)
                assert torch.equal(bt.slot_mapping.gpu[:n], ref), (num_reqs, q, bt.block_size)
            us = time_us(functools.partial(mg.compute_slot_mapping, num_reqs, qsl, pos), device)
            name = f"{num_reqs}x{q}" + ("" if len(groups) == 1 else f"_{len(groups)}groups")
            results[name] = us
            print(f"slot mapping {name:>14}: {us:8.2f} us", flush=True)
    return results


def commit_step_us(
    bt: BlockTable, rng: np.random.Generator, steps: int, moves: int, device: torch.device, busy: bool = False
) -> tuple[float, float]:
    """Median time per step of commit_block_table after one appended block per row (and
    `moves` row swaps), and the median host time of the call alone; every row must have room
    for `steps` more blocks."""
    samples, host, cuda = [], [], device.type == "cuda"
    for _ in range(steps):
        for r in range(bt.max_num_reqs):
            bt.append_row([int(rng.integers(1, 1 << 22))], r)
        for _ in range(moves):
            src, tgt = rng.choice(bt.max_num_reqs, size=2, replace=False)
            bt.swap_row(int(src), int(tgt))
        if cuda:
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(400_000)  # ~200 us of GPU work: the launches below queue behind it
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            bt.commit_block_table(bt.max_num_reqs)
            host.append((time.perf_counter() - t) * 1e6)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            bt.commit_block_table(bt.max_num_reqs)
            samples.append((time.perf_counter() - t) * 1e6)
            host.append(samples[-1])
    assert torch.equal(bt.block_table.gpu.cpu(), bt.block_table.cpu), "device table != CPU table"
    warm = len(samples) // 10  # first steps warm up
    return statistics.median(samples[warm:]), statistics.median(host[warm:])


def bench_commit(device: torch.device, sz: dict) -> dict[str, float]:
    results = {}
    for moves in (0, 4):
        for mode in ("full", "delta"):
            bt = BlockTable(16, sz["reqs"], -(-sz["model_len"] // 16), sz["tokens"], True, device, commit_mode=mode)
            rng = np.random.default_rng(1)
            for r in range(sz["reqs"]):
                n = int(rng.integers(1, bt.max_num_blocks_per_req - 2 * sz["steps"]))
                bt.add_row(rng.integers(1, 1 << 22, size=n).tolist(), r)
            bt.commit_block_table(sz["reqs"])
            us, host_us = commit_step_us(bt, rng, sz["steps"], moves, device)
            stream_us, _ = commit_step_us(bt, rng, sz["steps"], moves, device, busy=True)
            results[f"{mode}_moves{moves}"] = stream_us
            results[f"{mode}_moves{moves}_wall"] = us
            results[f"{mode}_moves{moves}_host"] = host_us
            print(
                f"commit {mode:>5}, {sz['reqs']} appends + {moves} swaps: stream {stream_us:8.2f} us, "
                f"wall {us:8.2f} us, host {host_us:.2f} us",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (interpreter)")
    args = ap.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    sz = sizes(smoke)
    slot = bench_slot_mapping(device, sz)
    commit = bench_commit(device, sz)
    if smoke:
        print("CPU smoke run (tiny sizes): nothing recorded")
        return
    for name, us in slot.items():
        metric = "slot_mapping_us_b256" if name == "256x1" else f"slot_mapping_us_{name}"
        record(SCRIPT, metric, us, "us")
    record(SCRIPT, "commit_delta_us_256req", commit["delta_moves0"], "us")
    record(SCRIPT, "commit_full_us_256req", commit["full_moves0"], "us")
    for mode in ("delta", "full"):
        record(SCRIPT, f"commit_{mode}_wall_us_256req", commit[f"{mode}_moves0_wall"], "us")
        record(SCRIPT, f"commit_{mode}_host_us_256req", commit[f"{mode}_moves0_host"], "us")
    record(SCRIPT, "commit_delta_us_256req_4swaps", commit["delta_moves4"], "us")
    record(SCRIPT, "commit_full_us_256req_4swaps", commit["full_moves4"], "us")
    record(SCRIPT, "commit_full_over_delta_ratio", commit["full_moves0"] / commit["delta_moves0"], "x")


if __name__ == "__main__":
    main()
