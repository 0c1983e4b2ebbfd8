"""Overlapped (async) scheduling, simulated: step N+1 is scheduled before step N's output is applied.

1. A randomized simulation (AsyncScheduler + KVCacheManager + a fake worker that feeds back the
   tokens it sampled itself): every request's output and finish reason equal the synchronous
   Scheduler's, under tight pools (preemption with tokens pending), chunked prefill, EOS and stop
   tokens that land late, max_tokens and max_model_len caps; the worker never computes a token it does
   not have nor a position at or past max_model_len; the pool is whole again at the end.
2. Aborts while steps are in flight (and a request id reused before the old step's output arrives).
The real engine and Ray with async scheduling: test_async_scheduling.py.
"""

import random
from collections import deque

import pytest

from kvcore.kv_cache_manager import KVCacheManager
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.request import Request, SamplingParams
from kvcore.sched.async_steps import AsyncScheduler
from kvcore.sched.scheduler import Scheduler
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

VOCAB = 61
EOS = 3


# ---------------------------------------------------------------- 1-2. simulation with a fake worker


def next_token(rid: str, pos: int, prev: int) -> int:
    """The fake model: depends on the previous token, so a worker feeding a wrong token diverges."""
    return (hash(rid) % 1000 * 31 + pos * 17 + prev * 7) % VOCAB


class FakeWorker:
    """What a real worker keeps (its own sampled tokens, computed counts), built from messages only."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.num_sampled = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, resumed, toks, computed in zip(
            c.req_ids, c.resumed_from_preemption, c.resumed_token_ids, c.num_computed_tokens, strict=True
        ):
            if resumed:
                self.tokens[rid] = list(toks)
            else:
                assert self.computed[rid] == computed, f"{rid}: worker computed {self.computed[rid]} != {computed}"
            self.computed[rid] = computed
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            self.computed[rid] += n
            assert self.computed[rid] <= len(tokens), f"{rid}: computing a token the worker does not have"
            assert self.computed[rid] <= self.max_model_len - 1 or self.computed[rid] == len(tokens), rid
            ids.append(rid)
            if self.computed[rid] == len(tokens):
                tok = next_token(rid, len(tokens), tokens[-1])
                tokens.append(tok)
                sampled.append([tok])
                self.num_sampled += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(ids, sampled, so.step_id)


def make_manager(num_blocks: int, hybrid: bool, max_model_len: int) -> KVCacheManager:
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32")
    groups = [KVCacheGroupSpec(["l0"], full)]
    if hybrid:
        groups.append(
            KVCacheGroupSpec(
                ["l1"], SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32", sliding_window=9)
            )
        )
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups), max_model_len)


def needs_run(so: SchedulerOutput) -> bool:
    return not so.is_empty or bool(so.finished_req_ids) or bool(so.preempted_req_ids)


def drive(
    sched: Scheduler,
    worker: FakeWorker,
    pipelined: bool,
    aborts: dict[int, list[str]] | None = None,
    late_requests: dict[int, Request] | None = None,
) -> dict[str, tuple[list[int], str]]:
    """Run to completion. Pipelined: the EngineCore's async order (submit N+1, then apply N)."""
    results: dict[str, tuple[list[int], str]] = {}
    inflight: deque = deque()
    step = 0

    def collect(outs):
        for o in outs:
            toks, _ = results.get(o.request_id, ([], None))
            results[o.request_id] = (toks + o.new_token_ids, o.finish_reason if o.finished else None)

    while sched.has_unfinished_requests() or inflight:
        step += 1
        assert step < 20_000, "no progress"
        if late_requests and step in late_requests:
            sched.add_request(late_requests[step])
        if aborts and step in aborts:
            sched.abort(aborts[step])
        so = sched.schedule()
        if not pipelined:
            out = worker.execute(so) if needs_run(so) else ModelRunnerOutput([], [], so.step_id)
            collect(sched.update_from_output(so, out))
            continue
        if needs_run(so):
            inflight.append((so, worker.execute(so)))
            if len(inflight) > 1:
                collect(sched.update_from_output(*inflight.popleft()))
        else:
            while inflight:
                collect(sched.update_from_output(*inflight.popleft()))
            collect(sched.update_from_output(so, ModelRunnerOutput([], [], so.step_id)))
    return results


def random_requests(rng: random.Random, n: int, max_model_len: int) -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i in range(n):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, min(25, max_model_len - len(prompt)))
        kind = rng.random()
        sp = SamplingParams(
            max_tokens=max_tokens, ignore_eos=kind < 0.3, stop_token_ids=[rng.randrange(4, VOCAB)] if kind > 0.6 else []
        )
        out.append((f"r{i}", prompt, sp))
    return out


@pytest.mark.parametrize(
    "seed,num_blocks,hybrid,budget",
    [(0, 200, False, 64), (1, 24, False, 16), (2, 30, True, 12), (3, 18, False, 64), (4, 40, True, 64)],
)
def test_async_equals_sync_simulation(seed, num_blocks, hybrid, budget):
    max_model_len = 48
    rng = random.Random(seed)
    reqs = random_requests(rng, 60, max_model_len)
    results, sampled = {}, {}
    for pipelined in (False, True):
        manager = make_manager(num_blocks, hybrid, max_model_len)
        worker = FakeWorker(max_model_len)
        cls = AsyncScheduler if pipelined else Scheduler
        sched = cls(
            manager,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            long_prefill_token_threshold=10 if hybrid else 0,
            debug_invariants=True,
        )
        for rid, prompt, sp in reqs:
            sched.add_request(Request(rid, prompt, sp, eos_token_id=EOS))
        results[pipelined] = drive(sched, worker, pipelined)
        sampled[pipelined] = worker.num_sampled
        assert manager.block_pool.num_free_blocks == num_blocks - 1, "blocks leaked"
        manager.check_invariants([])
        if pipelined:
            assert sched.num_pending_tokens == 0
            stats = sched.stats()
    assert results[True] == results[False]
    # Stops landed late: the async run computed tokens for requests already finished, and dropped them.
    assert sampled[True] > sampled[False] == sum(len(t) for t, _ in results[False].values())
    reasons = {r for _, r in results[True].values()}
    assert {"stop", "length"} <= reasons, reasons
    if num_blocks < 32:
        assert stats["num_preemptions"] > 0, stats


def test_async_aborts_and_reused_ids():
    """Aborts while steps are in flight, and an id reused right after its request finished: the old
    step's late token must not reach the new request."""
    max_model_len = 48
    manager = make_manager(30, False, max_model_len)
    sched = AsyncScheduler(
        manager, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=max_model_len, debug_invariants=True
    )
    # "x" stops (EOS) at its first token, which arrives after its next decode was scheduled (step 2);
    # its id comes back as a new request at step 3, before step 2's late token for the old one arrives.
    sched.add_request(Request("x", [5, 6, 7], SamplingParams(max_tokens=10), eos_token_id=next_token("x", 3, 7)))
    rng = random.Random(7)
    reqs = random_requests(rng, 30, max_model_len)
    for rid, prompt, sp in reqs:
        sched.add_request(Request(rid, prompt, sp, eos_token_id=EOS))
    aborts = {s: [f"r{rng.randrange(30)}" for _ in range(2)] for s in range(4, 80, 7)}
    reuse = {3: Request("x", [9, 9, 9, 9], SamplingParams(max_tokens=6, ignore_eos=True), eos_token_id=EOS)}
    results = drive(sched, FakeWorker(max_model_len), True, aborts, reuse)
    assert manager.block_pool.num_free_blocks == 29
    manager.check_invariants([])
    assert sched.num_pending_tokens == 0
    assert any(r == "abort" for _, r in results.values())
    # The reused id's tokens are the new request's own continuation (6 tokens from its prompt).
    toks, reason = results["x"]
    assert toks[0] == next_token("x", 3, 7)  # the old request's one token, then the new request's
    expected, prev = [], 9
    for pos in range(4, 10):
        prev = next_token("x", pos, prev)
        expected.append(prev)
    assert reason == "length" and toks[1:] == expected, (toks, expected)
