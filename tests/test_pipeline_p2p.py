"""The stage-to-stage path of actors/parallel_state.py in two processes (gloo): activations arrive in order
and intact, and a receive whose sender never sends fails at the collective timeout instead of hanging,
after which the groups refuse every transfer at once (they must be rebuilt)."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest

TIMEOUT_S = 2.0


def _stage(rank: int, init_method: str, silent_sender: bool, out: mp.Queue) -> None:
    import torch

    from actors import parallel_state as ps

    try:
        ps.init_model_parallel(rank, 1, 2, init_method, "gloo", timeout_s=60, collective_timeout_s=TIMEOUT_S)
        if rank == 0:
            for step in range(3):
                ps.send_to_next_stage([torch.full((4, 8), float(step)), torch.full((4, 8), -float(step))])
            ps.wait_for_sends()
            if silent_sender:
                time.sleep(600)  # alive, but never sends the next step (killed by the test once it has its answer)
            out.put((rank, "ok"))
            return
        hidden, residual = torch.empty(4, 8), torch.empty(4, 8)
        got = []
        for _ in range(3):
            ps.recv_from_prev_stage([hidden, residual])
            got.append((hidden[0, 0].item(), residual[0, 0].item()))
        result: dict = {"got": got}
        if silent_sender:
            try:  # while the sender still lives (it sleeps past the timeout): a raise, not a hang
                ps.recv_from_prev_stage([hidden, residual])
                result["late"] = "returned"
            except ps.CollectiveError as e:
                result["late"] = str(e)
            try:
                ps.recv_from_prev_stage([hidden])
                result["after"] = "returned"
            except ps.CollectiveError as e:
                result["after"] = str(e)
        out.put((rank, result))
    except BaseException:  # noqa: BLE001 - the test reports it
        out.put((rank, traceback.format_exc()))


def run_stages(silent_sender: bool, rendezvous_dir) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # A file rendezvous: a free port picked here could be taken before rank 0 binds it (a loaded host).
    init = f"file://{rendezvous_dir}/rendezvous"
    procs = [ctx.Process(target=_stage, args=(r, init, silent_sender, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        # The silent sender never answers; the receiver must, long before the sender would ever end.
        wanted = 1 if silent_sender else 2
        return dict(out.get(timeout=120) for _ in range(wanted))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def test_activations_arrive_in_order(tmp_path):
    results = run_stages(silent_sender=False, rendezvous_dir=tmp_path)
    assert results[0] == "ok", results[0]
    assert results[1] == {"got": [(0.0, -0.0), (1.0, -1.0), (2.0, -2.0)]}, results[1]


def test_a_silent_previous_stage_fails_the_receive_at_the_timeout(tmp_path):
    results = run_stages(silent_sender=True, rendezvous_dir=tmp_path)
    assert set(results) == {1}, results
    r = results[1]
    assert isinstance(r, dict), r
    assert "receive from the previous stage failed on stage 1" in r["late"], r
    assert "out of step" in r["after"] and "must be rebuilt" in r["after"], r


pytestmark = pytest.mark.timeout(300)
