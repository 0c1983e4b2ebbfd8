"""A worker with no model: it follows the Worker contract and answers every step at once with a fixed
token, so the control plane (schedule + broadcast + reply) can be timed alone, and faults (a hang,
an exit) can be injected at a chosen step for the failure tests.

It can stand in for a model of fixed cost: KVRAY_NOOP_MODEL_S seconds a step (default 0), split evenly
over the pipeline stages. A later stage first waits for the previous stage's (tiny) activation of the
step over the real point-to-point path, then every stage spends its share and sends on, so the
pipelining of the engine's batch queue can be measured without a model (benchmarks/host/bench_pipeline.py).
"""

from __future__ import annotations

import os
import time

import torch

from actors import parallel_state
from actors.config.engine import EngineConfig
from actors.transport.shm_reader import ShmLoopMixin
from kvcore.messages import ModelRunnerOutput, SchedulerOutput
from kvcore.spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec

FAKE_TOKEN = 7
MODEL_TIME_ENV = "KVRAY_NOOP_MODEL_S"  # a step's cost over all stages together


class NoopWorker(ShmLoopMixin):
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        world_size: int,
        dist_init_method: str | None,
        device_index: int | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.num_tokens: dict[str, int] = {}  # tokens each request holds: prompt + sampled so far
        self.fault: tuple[str, int] | None = None
        self.steps = 0
        # Async scheduling: like the model runner, answer each step with the previous step's output.
        self.lag_outputs = config.use_async_scheduling
        self._held: ModelRunnerOutput | None = None
        p = config.parallel
        self.pp_size = p.pipeline_parallel_size
        self.pp_rank = rank // p.tensor_parallel_size
        # The answering rank: the last stage's first TP rank (rank 0 without stages).
        self.answers = rank == (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        self.stage_time_s = float(os.environ.get(MODEL_TIME_ENV, "0") or 0) / self.pp_size
        self._inbox = torch.zeros(1)  # what the previous stage sends (never the tensor this stage is sending)

    # ---- the Worker contract ----------------------------------------------------------------
    def open_rendezvous(self) -> int:
        return parallel_state.open_rendezvous(self.world_size, self.config.parallel.step_timeout_s)

    def init_device(self, dist_init_method: str | None = None) -> None:
        if self.pp_size > 1:  # the stages' point-to-point path is real; TP collectives are not used
            p = self.config.parallel
            parallel_state.init_model_parallel(
                self.rank,
                p.tensor_parallel_size,
                self.pp_size,
                dist_init_method,
                "gloo",
                timeout_s=p.step_timeout_s,
                collective_timeout_s=p.resolved_collective_timeout_s,
            )

    def start_phases(self, requested: float) -> dict[str, float]:
        return {}

    def load_model(self) -> None:
        pass

    def get_max_model_len(self) -> int:
        return self.config.model.max_model_len or 4096

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {"layers.0.attn": FullAttentionSpec(self.config.cache.block_size, 1, 8, torch.float32)}

    def determine_num_blocks(self, layer_specs: dict[str, KVCacheSpec] | None = None) -> int:
        return self.config.cache.num_gpu_blocks or 4096

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        pass

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.steps += 1
        self._maybe_fault()
        if (self.pp_size > 1 or self.stage_time_s) and not so.is_empty:
            self._run_stage(so.step_id)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.num_tokens.pop(rid, None)
        computed: dict[str, int] = {}
        for nr in so.scheduled_new_reqs:
            self.num_tokens[nr.req_id] = len(nr.prompt_token_ids) + len(nr.output_token_ids or ())
            computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            resumed = c.resumed_token_ids[i]
            if resumed is not None:
                self.num_tokens[rid] = len(resumed)
            computed[rid] = c.num_computed_tokens[i]
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req_ids.append(rid)
            # A token is sampled only once the step reaches the end of what the request holds.
            if computed.get(rid, 0) + n >= self.num_tokens.get(rid, 0):
                sampled.append([FAKE_TOKEN])
                self.num_tokens[rid] = self.num_tokens.get(rid, 0) + 1
            else:
                sampled.append([])
        if not self.answers:
            return None
        out = ModelRunnerOutput(req_ids, sampled, step_id=so.step_id)
        if not self.lag_outputs:
            return out
        held, self._held = self._held, (None if so.is_empty else out)
        return held

    def _run_stage(self, step_id: int) -> None:
        """Receive the step's activation from the previous stage, spend the stage's time, send it on."""
        if self.pp_rank > 0:
            parallel_state.recv_from_prev_stage([self._inbox])
            got = int(self._inbox.item())
            if got != step_id:
                raise RuntimeError(f"stage {self.pp_rank} got step {got}'s activation for step {step_id}")
        if self.stage_time_s:
            time.sleep(self.stage_time_s)
        if self.pp_rank < self.pp_size - 1:
            parallel_state.send_to_next_stage([torch.tensor([float(step_id)])])  # a fresh tensor per send

    def ping(self) -> int:
        return self.rank

    def reset_requests(self) -> None:
        self.num_tokens.clear()
        self._held = None

    def shutdown(self) -> None:
        self.num_tokens.clear()
        if self.pp_size > 1:
            parallel_state.destroy_tensor_parallel()

    # ---- fault injection --------------------------------------------------------------------
    def inject_fault(self, kind: str, at_step: int) -> None:
        """kind "hang" (sleep through the step) or "exit" (the process dies) at step `at_step`, or
        "raise" (that one step raises ValueError on this rank alone; the others answer)."""
        if kind not in ("hang", "exit", "raise"):
            raise ValueError(f"inject_fault: kind={kind!r} must be 'hang', 'exit' or 'raise'")
        self.fault = (kind, at_step)

    def _maybe_fault(self) -> None:
        if self.fault is None or self.steps < self.fault[1]:
            return
        if self.fault[0] == "raise":
            self.fault = None
            raise ValueError(f"injected fault: rank {self.rank} raises at step {self.steps}")
        if self.fault[0] == "exit":
            os._exit(1)
        time.sleep(3600)
