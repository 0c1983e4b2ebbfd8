"""The model-parallel groups meet at a store rank 0 hosts on a port it bound at once
(parallel_state.open_rendezvous). A port found free first and bound a moment later could be taken in
between by another process on the host (two test suites side by side once failed a TP=2 engine start
with EADDRINUSE); this checks that the port handed out is already held, so nobody can take it, and that
the ranks form their groups on it."""

from __future__ import annotations

import errno
import multiprocessing as mp
import socket
import traceback

import pytest

pytestmark = pytest.mark.timeout(120)


def _rank(rank: int, world: int, ports: mp.Queue, addresses: mp.Queue, out: mp.Queue) -> None:
    try:
        import torch

        from actors import parallel_state as ps

        if rank == 0:
            ports.put(ps.open_rendezvous(world, timeout_s=60))
        ps.init_model_parallel(rank, world, 1, addresses.get(timeout=60), "gloo", timeout_s=60)
        total = ps.all_reduce(torch.full((3,), float(rank + 1)))
        out.put((rank, total.tolist()))
        ps.destroy_tensor_parallel()
    except BaseException:  # noqa: BLE001 - the test reports it
        out.put((rank, traceback.format_exc()))


def test_the_rendezvous_port_is_held_from_the_moment_it_is_handed_out():
    world = 3
    ctx = mp.get_context("spawn")
    ports, addresses, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, ports, addresses, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        port = ports.get(timeout=60)
        # Another process on the host trying the port now (what took it before rank 0 bound it) is refused.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
            with pytest.raises(OSError) as refused:
                squatter.bind(("", port))
            assert refused.value.errno == errno.EADDRINUSE
        for _ in range(world):
            addresses.put(f"tcp://127.0.0.1:{port}")
        got = dict(out.get(timeout=90) for _ in range(world))
        assert got == {r: [6.0, 6.0, 6.0] for r in range(world)}, got
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
