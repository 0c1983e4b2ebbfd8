"""The stress test's reference (cluster/stress/run.py, check 2): every request of the workload run alone, at
once, on one roomy replica without prefix caching or preemption; its tokens are what the stressed run
must have produced. A request's tokens never depend on its neighbours (the sampler draws per request),
so one batch is as good as one run each.
"""

from __future__ import annotations

from actors.messages import RequestSpec
from cluster.client.stream import Stream
from cluster.config import EngineConfig
from cluster.replicas.engine_group import EngineFailure, EngineGroup
from cluster.stress.workload import StressRequest
from kvcore.messages import EngineCoreOutput


def reference_config(
    config: EngineConfig, workload: list[StressRequest], block_size: int, num_groups: int
) -> EngineConfig:
    """One replica, no prefix caching, no preemption: room for every request at once."""
    blocks = 1 + sum(
        num_groups * (-(-(len(r.prompt_token_ids) + r.sampling.max_tokens) // block_size) + 1) for r in workload
    )
    seqs = min(len(workload), 256)
    longest = max(len(r.prompt_token_ids) + r.sampling.max_tokens for r in workload)
    return config.replace(
        data_parallel_size=1,
        enable_prefix_caching=False,
        num_gpu_blocks=blocks,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(seqs, 4096, longest),
        debug_invariants=False,
        max_worker_restarts=0,
    )


class ReferenceRun(Stream):
    """Every request at once; each output's tokens, kept by request."""

    poll_s = 1.0

    def __init__(self, engines: EngineGroup, workload: list[StressRequest], stall_s: float) -> None:
        super().__init__(engines)
        # The same stall rule as the stressed run: an engine that stops producing without failing must
        # not hang the check forever.
        self.stall_s = stall_s
        self.workload: list[StressRequest] | None = workload
        self.tokens: dict[str, list[int]] = {r.request_id: [] for r in workload}
        self.open_ids = set(self.tokens)

    def due(self) -> list[RequestSpec] | None:
        workload, self.workload = self.workload, None
        return (
            None
            if workload is None
            else [RequestSpec(r.request_id, list(r.prompt_token_ids), r.sampling) for r in workload]
        )

    def in_flight(self) -> int:
        return len(self.open_ids)

    def refused(self, errors: dict[str, str]) -> None:
        if errors:
            rid, err = next(iter(errors.items()))
            raise RuntimeError(f"reference run refused {len(errors)} request(s), e.g. {rid}: {err}")

    def take(self, out: EngineCoreOutput) -> None:
        self.tokens[out.request_id].extend(out.new_token_ids)
        if out.finished:
            if out.finish_reason == "error":
                raise RuntimeError(f"reference run: request {out.request_id}: {out.error}")
            self.open_ids.discard(out.request_id)


def run_reference(config: EngineConfig, workload: list[StressRequest]) -> dict[str, list[int]]:
    engines = EngineGroup(config)
    try:
        ref = ReferenceRun(engines, workload, stall_s=max(120.0, 2 * config.parallel.step_timeout_s))
        try:
            ref.loop()
        except EngineFailure as e:
            raise EngineFailure(f"reference run: {e}") from None
        return ref.tokens
    finally:
        engines.shutdown()
