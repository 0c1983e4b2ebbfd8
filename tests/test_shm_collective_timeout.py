"""A hung collective never hangs the job. With gloo on the CPU: a rank that waits in a collective for a
peer that never comes raises CollectiveError within parallel.collective_timeout_s, and its group then
refuses every collective (it is out of step); the driver reads a step where one rank failed on its own
and the others timed out waiting for it as a WorkerFailure naming the first, and rebuilds the TP group.
End to end (TP=2, shm transport): rank 1 fails a step before its forward, rank 0 times out in the
all-reduce, the group is rebuilt within the restart budget and every request still gets its tokens."""
import multiprocessing as mp
import os
import socket
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import ray

from actors.executor_base import WorkerFailure
from actors.poison import StepError
from actors.transport import step_failure
from cluster import LLM, SamplingParams
from cluster.placement import start_local_ray

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, queue):
    import torch

    from actors import parallel_state as ps

    ps.init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60, collective_timeout_s=1)
    if rank == 1:  # fails its step before the collective: rank 0 waits for it
        queue.put((1, "skipped"))
        time.sleep(2.5)  # alive (its sockets open) past rank 0's timeout
        return
    results = []
    for _ in range(2):
        try:
            ps.all_reduce(torch.ones(4))
            results.append("ok")
        except ps.CollectiveError as e:
            results.append(str(e))
    queue.put((0, results))


def test_a_collective_waiting_for_a_failed_rank_times_out_and_the_group_refuses_more():
    ctx = mp.get_context("fork")  # torch is imported already: the ranks start at once
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
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
    f = step_failure([(0, "CollectiveError('all_reduce failed on tensor-parallel rank 0: timed out')", True),
                      (1, "ValueError('bad input')", False)])
    assert isinstance(f, WorkerFailure) and f.rank == 1
    assert "ValueError('bad input')" in str(f) and "rank(s) [0] waited for it in a collective" in str(f)
    assert isinstance(step_failure([(1, "ValueError('x')", False)]), StepError)  # all in step: poison hunt
    lone = step_failure([(1, "CollectiveError('peer gone')", True)])
    assert isinstance(lone, WorkerFailure) and lone.rank == 1 and "out of step" in str(lone)


def test_tp2_rank_failing_before_its_forward_is_recovered_by_a_rebuild():
    start_local_ray(num_cpus=3, include_dashboard=False)
    llm = LLM(model="tiny-random", device="cpu", tensor_parallel_size=2, max_model_len=64, num_gpu_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=64, step_timeout_s=30, collective_timeout_s=4,
              max_worker_restarts=1, transport="shm")
    try:
        prompts = [{"prompt_token_ids": [5 + i, 9, 40 - i]} for i in range(2)]
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        first = llm.generate(prompts, params, use_tqdm=False)
        want = [list(o.outputs[0].token_ids) for o in first]
        bad = str(int(first[-1].request_id) + 2)  # the second request of the next call
        ray.get(llm.engines.drivers[0].worker_call.remote(1, "fail_steps_with", [bad], True))
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[1].request_id == bad
        assert [o.error for o in outs] == [None, None]
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert llm.stats()[0]["worker_restarts"] == 1  # the group was rebuilt, the fault gone with it
    finally:
        llm.shutdown()
        ray.shutdown()
