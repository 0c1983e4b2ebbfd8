"""A hung collective never hangs the job. With gloo on the CPU: a rank that waits in a collective for a
peer that never comes raises CollectiveError within parallel.collective_timeout_s, and its group then
refuses every collective (it is out of step); the driver reads a step where one rank failed on its own
and the others timed out waiting for it as a WorkerFailure naming the first, and rebuilds the TP group.
End to end (TP=2): tests/test_shm_transport.py."""

import multiprocessing as mp
import time

import pytest

from actors.errors import CollectiveError, StepError, WorkerFailure
from actors.transport.broadcast import step_failure

pytestmark = pytest.mark.timeout(60)


def _rank(rank, init_method, queue):
    import torch

    from actors import parallel_state as ps

    ps.init_tensor_parallel(rank, 2, init_method, "gloo", timeout_s=60, collective_timeout_s=1)
    if rank == 1:  # fails its step before the collective: rank 0 waits for it
        queue.put((1, "skipped"))
        time.sleep(2.5)  # alive (its sockets open) past rank 0's timeout
        return
    results = []
    for _ in range(2):
        try:
            ps.all_reduce(torch.ones(4))
            results.append("ok")
        except CollectiveError as e:
            results.append(str(e))
    queue.put((0, results))


def test_a_collective_waiting_for_a_failed_rank_times_out_and_the_group_refuses_more(tmp_path):
    ctx = mp.get_context("fork")  # torch is imported already: the ranks start at once
    queue = ctx.Queue()
    init_method = f"file://{tmp_path}/rendezvous"  # no port to race for on a loaded host
    procs = [ctx.Process(target=_rank, args=(r, init_method, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=120) for _ in range(2))
        first, second = got[0]
        assert "all_reduce failed on tensor-parallel rank 0" in first, first
        assert "out of step since an earlier collective failed" in second, second
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_a_rank_failing_alone_while_others_time_out_is_a_worker_failure_naming_it():
    f = step_failure(
        [
            (0, "CollectiveError('all_reduce failed on tensor-parallel rank 0: timed out')", True),
            (1, "ValueError('bad input')", False),
        ]
    )
    assert isinstance(f, WorkerFailure) and f.rank == 1
    assert "ValueError('bad input')" in str(f) and "rank(s) [0] waited for it in a collective" in str(f)
    assert isinstance(step_failure([(1, "ValueError('x')", False)]), StepError)  # all in step: poison hunt
    lone = step_failure([(1, "CollectiveError('peer gone')", True)])
    assert isinstance(lone, WorkerFailure) and lone.rank == 1 and "out of step" in str(lone)
