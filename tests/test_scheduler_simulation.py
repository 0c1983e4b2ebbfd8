"""Randomized end-to-end simulation: Scheduler + KVCacheManager + a fake worker that knows only the
messages. 1,000 requests with shared prefixes and random aborts, under a pool small enough to force
preemption. Checked after every step: block accounting, and that the block tables the worker rebuilds
from the deltas alone equal the manager's rows."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kvcore import Request, SamplingParams
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.sched.scheduler import Scheduler
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

VOCAB = 50_000


def fake_token(rid: str, pos: int) -> int:
    """The model's deterministic choice: a function of the request and the position only."""
    return (int(rid[1:]) * 7919 + pos * 104729) % VOCAB


class FakeWorker:
    """Holds what a real worker holds (rows, token ids, computed counts), built from messages only."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[list[int], ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self._drop(rid)
        for rid in out.preempted_req_ids:
            assert rid in self.rows, f"preempted {rid} was not running on the worker"
            self._drop(rid)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows, f"new request {new.req_id} already has a row"
            self.rows[new.req_id] = tuple(list(g) for g in new.block_ids)
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        c = out.scheduled_cached_reqs
        for rid, resumed, delta, token_ids, computed in zip(
            c.req_ids,
            c.resumed_from_preemption,
            c.new_block_ids,
            c.resumed_token_ids,
            c.num_computed_tokens,
            strict=True,
        ):
            if resumed:
                assert rid not in self.rows, f"resumed {rid} still has a row"
                self.rows[rid] = tuple(list(g) for g in delta)
                self.tokens[rid] = list(token_ids)
            else:
                assert rid in self.rows, f"cached request {rid} has no row"
                assert self.computed[rid] == computed, f"{rid}: worker computed {self.computed[rid]} != {computed}"
                if delta is not None:
                    for row, add in zip(self.rows[rid], delta, strict=True):
                        row.extend(add)
            self.computed[rid] = computed

    def _drop(self, rid: str) -> None:
        self.rows.pop(rid, None)
        self.tokens.pop(rid, None)
        self.computed.pop(rid, None)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            self.computed[rid] += n
            tokens = self.tokens[rid]
            assert self.computed[rid] <= len(tokens), f"{rid}: computing tokens it does not have"
            ids.append(rid)
            if self.computed[rid] == len(tokens):
                tok = fake_token(rid, len(tokens))
                tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(ids, sampled, out.step_id)


def assert_rows_match(worker_row: tuple[list[int], ...], manager_row: tuple[list[int], ...]) -> None:
    """Equal, except where a sliding window has since dropped a block: the manager holds the null
    block 0 there, the worker the old id, which attention never reads again."""
    assert len(worker_row) == len(manager_row)
    if 0 not in (b for m in manager_row for b in m):
        assert worker_row == manager_row
    for w, m in zip(worker_row, manager_row, strict=True):
        assert len(w) == len(m) and all(a == b or b == 0 for a, b in zip(w, m, strict=True)), (w, m)


def check_blocks(sched: Scheduler) -> None:
    manager = sched.kv_cache_manager
    pool = manager.block_pool
    held: Counter = Counter()
    for req in sched.running:
        for row in manager.get_block_ids(req.request_id):
            held.update(b for b in row if b != 0)
    referenced = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert pool.num_free_blocks + referenced == pool.num_blocks - 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == held.get(block.block_id, 0), f"block {block.block_id}: ref {block.ref_cnt}"


def run_simulation(
    seed: int,
    num_requests: int,
    groups: list[KVCacheGroupSpec],
    num_blocks: int,
    threshold: int,
    caching: bool = True,
    fast_path: bool = True,
    trace: list | None = None,
) -> Scheduler:
    rng = random.Random(seed)
    max_model_len = 64
    manager = KVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len, enable_caching=caching)
    sched = Scheduler(
        manager,
        max_num_seqs=12,
        max_num_batched_tokens=48,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
        debug_invariants=True,
    )
    if not fast_path:
        sched.fast_block_size = 1  # ask the manager every step, as vLLM does
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice([4, 8, 13, 16]))] for _ in range(6)]
    requests: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    aborted: set[str] = set()
    worker = FakeWorker()
    next_id = 0
    while next_id < num_requests or sched.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 2, 3]) if next_id < num_requests else 0):
            rid = f"r{next_id}"
            next_id += 1
            prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + [
                rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))
            ]
            req = Request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True), eos_token_id=0)
            requests[rid] = req
            sched.add_request(req)
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(sched.requests))
            sched.abort([victim])
            aborted.add(victim)
        out = sched.schedule()
        if trace is not None:
            trace.append(
                (
                    out.num_scheduled_tokens,
                    [(n.req_id, n.block_ids) for n in out.scheduled_new_reqs],
                    out.scheduled_cached_reqs,
                    out.preempted_req_ids,
                    out.finished_req_ids,
                )
            )
        worker.apply(out)
        for req in sched.running:
            assert_rows_match(worker.rows[req.request_id], manager.get_block_ids(req.request_id))
        assert set(worker.rows) == {r.request_id for r in sched.running}
        check_blocks(sched)
        step_outs = sched.update_from_output(out, worker.execute(out) if not out.is_empty else None)
        check_blocks(sched)
        for o in step_outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in finish, f"{o.request_id} finished twice"
                finish[o.request_id] = o.finish_reason

    assert set(finish) == set(requests)
    for rid, req in requests.items():
        if rid in aborted:
            assert finish[rid] == "abort"
            continue
        want = [fake_token(rid, req.num_prompt_tokens + i) for i in range(req.max_tokens)]
        assert finish[rid] == "length" and outputs[rid] == want, rid
        assert req.output_token_ids == want
    assert manager.block_pool.num_free_blocks == num_blocks - 1 and manager.usage == 0.0
    assert not sched.requests and not sched.running and not sched.waiting
    assert sched.num_preemptions > 0
    print(
        f"seed {seed}: {out.step_id} steps, {sched.num_preemptions} preemptions, {len(aborted)} aborts, "
        f"stats {sched.stats()}"
    )
    return sched


def test_simulation_full_attention():
    spec = FullAttentionSpec(4, 1, 8, torch.float32)
    # 30 usable blocks of 4 tokens for 12 sequences of up to 44 tokens: preemption is certain.
    sched = run_simulation(
        seed=0, num_requests=1000, groups=[KVCacheGroupSpec(["l0"], spec)], num_blocks=31, threshold=16
    )
    stats = sched.stats()
    assert sched.num_preemptions > 20, sched.num_preemptions
    assert stats["prefix_cache_hits"] > 0


def test_simulation_without_prefix_caching():
    spec = FullAttentionSpec(4, 1, 8, torch.float32)
    sched = run_simulation(
        seed=3, num_requests=300, groups=[KVCacheGroupSpec(["l0"], spec)], num_blocks=31, threshold=0, caching=False
    )
    assert sched.stats()["prefix_cache_hits"] == 0


def test_fast_path_matches_asking_the_manager_every_step():
    # Skipping allocate_slots when no block changes must not change a single decision or block id.
    spec = FullAttentionSpec(4, 1, 8, torch.float32)
    traces: list[list] = [[], []]
    for fast, trace in zip([True, False], traces, strict=True):
        run_simulation(
            seed=4,
            num_requests=300,
            groups=[KVCacheGroupSpec(["l0"], spec)],
            num_blocks=31,
            threshold=8,
            fast_path=fast,
            trace=trace,
        )
    assert len(traces[0]) == len(traces[1])
    for a, b in zip(*traces, strict=True):
        assert a == b


@pytest.mark.parametrize("threshold", [0, 8])
def test_simulation_hybrid_sliding_window(threshold):
    full = FullAttentionSpec(4, 1, 8, torch.float32)
    sw = SlidingWindowSpec(4, 1, 8, torch.float32, sliding_window=8)
    groups = [KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], sw)]
    sched = run_simulation(seed=1 + threshold, num_requests=300, groups=groups, num_blocks=41, threshold=threshold)
    assert sched.num_preemptions > 0
