"""Helpers for the scheduler tests: a Scheduler on a real KVCacheManager, requests, and a fake model
runner that answers each step (test_scheduler.py, test_scheduler_stops.py)."""

from __future__ import annotations

import torch

from kvcore import Request, SamplingParams
from kvcore.kv_cache_manager import KVCacheManager
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.sched.scheduler import Scheduler
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 1024,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    threshold: int = 0,
    sliding_window: int | None = None,
    caching: bool = True,
    **kwargs,
) -> Scheduler:
    full = FullAttentionSpec(block_size, 1, 8, torch.float32)
    groups = [KVCacheGroupSpec(["l0"], full)]
    if sliding_window is not None:
        sw = SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=sliding_window)
        groups.append(KVCacheGroupSpec(["l1"], sw))
    manager = KVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len, enable_caching=caching)
    return Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
        debug_invariants=True,
        **kwargs,
    )


def make_request(
    rid: str,
    num_prompt: int,
    max_tokens: int = 16,
    start: int = 0,
    ignore_eos: bool = True,
    eos: int | None = None,
    stop: tuple[int, ...] = (),
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop))
    return Request(rid, list(range(start, start + num_prompt)), params, eos_token_id=eos)


def default_token(rid: str, pos: int) -> int:
    return 1000 + pos


def run_output(sched: Scheduler, out: SchedulerOutput, token_fn=default_token) -> ModelRunnerOutput:
    """A fake model runner: one token for every request whose prefill completes this step."""
    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([token_fn(rid, req.num_tokens)] if done else [])
    return ModelRunnerOutput(ids, sampled, out.step_id)


def step(sched: Scheduler, token_fn=default_token):
    out = sched.schedule()
    return out, sched.update_from_output(out, run_output(sched, out, token_fn))


def drain(sched: Scheduler, token_fn=default_token, max_steps: int = 10_000) -> dict[str, list]:
    """Run to completion; returns req_id -> list of its EngineCoreOutputs."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        for o in step(sched, token_fn)[1]:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("scheduler did not drain")


def tokens_of(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
