"""The model runner: one rank's model, paged KV cache and persistent batch; prepare -> launch -> complete.

Each step it applies the scheduler's deltas to the InputBatch, stages the step's per-row record (the
device builds the inputs from it, actors/worker/input_prep.py), replays the step's CUDA graph (or runs it
eagerly, actors/worker/cuda_graphs.py), samples, and remembers the tokens it sampled: the scheduler never
sends them back, and the next step takes them as inputs straight from the device. With async
scheduling it answers each step with the previous step's output: step N+1 is launched before step N's
tokens are read back, so the host work of both steps overlaps the GPU's. No host synchronisation
happens anywhere before the read-back.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from actors import parallel_state
from actors.config.engine import EngineConfig
from actors.config.model_rules import resolved_max_model_len, stage_layer_range
from actors.input_batch import CachedRequestState, InputBatch
from actors.models.stage import PipelineStage, StageActivations
from actors.profiling.step_profiler import StepTimer
from actors.sample.inputs import SamplingInputs
from actors.sample.logit_rows import LogitRows
from actors.sample.logprobs import MAX_LOGPROBS
from actors.sample.penalties import PenaltyState
from actors.sample.sampler import Sampler, request_seed
from actors.sample.step_logprobs import LogprobsCollector, compute_prompt_logprobs, launch_copies, prompt_plan
from actors.worker import kv_cache_sizing
from actors.worker.compile_ahead import CompiledAhead, compile_ahead, compile_threads, pass_fingerprint
from actors.worker.forward import GraphRunner
from actors.worker.input_prep import InputStager, StagedStep
from actors.worker.token_readback import SampledStep, TokenReadback
from actors.worker.warmup import warm_logits, warm_sampler
from kvcore.kernels import check_backend
from kvcore.kernels.attention_tiles import longest_first_max_seqs, num_sms
from kvcore.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvcore.spec import KVCacheConfig, KVCacheSpec

if TYPE_CHECKING:  # the model zoo is imported only where a model is loaded
    from actors.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


def _every_rank(all_on_disk: bool) -> bool:
    """True when every rank of the engine found its pass's variants on disk (compile_ahead's `agree`)."""
    return parallel_state.all_reduce_min(int(all_on_disk)) == 1


def resolve_attention_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    check_backend(name, "model.attention_backend")
    return name


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, rank: int) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        self.backend = resolve_attention_backend(config.model.attention_backend, device)
        self.pin_memory = device.type == "cuda"
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.model: DecoderForCausalLM | None = None
        self.hf_config: Any = None
        self.max_model_len = 0
        self.dtype = torch.float32
        self.sampler = Sampler()
        self.penalty_state: PenaltyState | None = None  # built with the model (it needs the vocabulary)
        self.logit_rows: LogitRows | None = None  # likewise
        self.logprobs = LogprobsCollector()
        self.eos_token_id: int | None = None
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch: InputBatch | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Marks the end of a step's sampling-parameter copies: the next step waits on it before editing
        # their pinned sources again.
        self._copies_done: torch.cuda.Event | None = None
        self.step_timer: StepTimer | None = None  # set by the GPU idle benchmark (Worker.start_step_timing)
        self.lag_outputs = config.use_async_scheduling
        self.readback = TokenReadback(self.max_num_reqs, device, self.pin_memory)
        self.stager = InputStager(self.max_num_reqs, self.max_num_tokens, device, self.pin_memory)
        # The step's forward: its CUDA graphs (captured with the KV cache) or the same step run eagerly.
        self.graph_runner = GraphRunner(config, device, rank, self.backend, self.stager)
        self._in_flight: SampledStep | None = None  # lag mode: launched, output not yet returned
        self._last: SampledStep | None = None  # the last launched step: the next one's feed source
        self.sampling_inputs = SamplingInputs(self.max_num_reqs, device, self.pin_memory)
        # Start-up's kernel variants compile on a thread pool in dry passes (actors/worker/compile_ahead.py).
        self.compile_threads = compile_threads(config.parallel.ranks_per_engine)
        self.compiled_ahead: list[CompiledAhead] = []
        # Pipeline parallelism: this rank's stage (the process joined its groups before building the runner).
        self.pp_rank, self.pp_size = parallel_state.pp_rank(), parallel_state.pp_size()
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == self.pp_size - 1
        # The rank whose output the driver reads: the last stage's first TP rank (rank 0 without stages).
        self.answers = self.is_last_stage and parallel_state.tp_rank() == 0
        self.stage_inputs: StageActivations | None = None  # a later stage's receive buffers

    # ---- model and KV cache -----------------------------------------------------------------
    def load_model(self) -> None:
        from actors.models.loader import load_model  # the loader pulls in the model zoo; only workers need it

        self.model, self.hf_config = load_model(
            self.config.model.model,
            dtype=self.config.model.dtype,
            attention_backend=self.backend,
            device=self.device,
            quantization=self.config.model.quantization,
            stage_for=self._stage_for if self.pp_size > 1 else None,
        )
        self.model.eval()
        if not self.is_first_stage:
            # Fixed buffers, so a CUDA graph reads what each step receives from the previous stage.
            self.stage_inputs = self.model.empty_activations(self.max_num_tokens, self.device)
        self.dtype = self.model.dtype  # the activations' dtype (fp8 weights are buffers of their own)
        self.max_model_len = resolved_max_model_len(self.config, self.hf_config)
        eos = self._hf("eos_token_id")
        self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos  # as the driver's stop check
        self.penalty_state = PenaltyState(int(self._hf("vocab_size")), self.device)
        self.logit_rows = LogitRows(int(self._hf("vocab_size")), self.device)
        self.sampler = Sampler(self.penalty_state, logit_rows=self.logit_rows)

    def _stage_for(self, num_layers: int) -> PipelineStage:
        start, end = stage_layer_range(self.config, num_layers, self.pp_rank)
        return PipelineStage(start, end, self.is_first_stage, self.is_last_stage)

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return kv_cache_sizing.kv_cache_specs(
            self._model(),
            self.config.cache.block_size,
            kv_cache_sizing.cache_dtype(self.config.cache.kv_cache_dtype, self.dtype, self.device),
            hybrid=not self.config.cache.disable_hybrid_kv_cache_manager,
        )

    def profile_run(self) -> None:
        """The profile forward (kv_cache_sizing.profile_run), its kernels first compiled ahead."""
        self._compile_ahead(self._profile_forward, "profile", self.max_num_tokens, self.max_model_len)
        self._profile_forward()

    def _compile_ahead(self, fn: Callable[[], object], *pass_shapes: object) -> None:
        """`fn` run dry first; `pass_shapes` (the pass's name and what sizes its launches) with the engine's
        and the model's config make the pass's fingerprint, under which a warm cache lets it be skipped."""
        fingerprint = None
        if self.device.type == "cuda" and self.compile_threads > 0:
            hf = self.hf_config if isinstance(self.hf_config, dict) else getattr(self.hf_config, "to_dict", dict)()
            try:
                model = json.dumps(hf, sort_keys=True, default=str)
                fingerprint = pass_fingerprint(self.device, *pass_shapes, self.config, model, self.dtype, self.rank)
            except Exception as e:  # noqa: BLE001 - without a fingerprint the pass just runs, as on a cold cache
                logger.warning("no compile-ahead fingerprint (%s: %s): the dry pass runs", type(e).__name__, e)
        done = compile_ahead(fn, self.device, self.compile_threads, fingerprint, agree=_every_rank)
        if done is not None:
            self.compiled_ahead.append(done)

    def _profile_forward(self) -> None:
        rows = min(self.max_num_reqs, self.max_num_tokens)
        # The step's logprobs (a vocabulary-wide log_softmax and top-k) are part of its peak; the sampling
        # kernel itself allocates nothing. (The CPU budget is configured, not profiled.)
        kv_cache_sizing.profile_run(
            self._model(),
            self.max_num_tokens,
            rows,
            self.max_model_len,
            self.device,
            self.stage_inputs,
            lambda logits: (
                self.device.type == "cuda"
                and self.sampler(logits, self.sampling_inputs.dummy(rows, True, MAX_LOGPROBS))
            ),
        )

    def determine_num_blocks(self, layer_specs: dict[str, KVCacheSpec] | None = None) -> int:
        """Blocks this rank can hold; `layer_specs` (every stage's layers) lays the blocks out as the
        engine's groups will, of which this rank holds its own layers."""
        own = self.get_kv_cache_specs()
        groups = None if layer_specs is None else kv_cache_sizing.own_groups(layer_specs, own)
        return kv_cache_sizing.determine_num_blocks(
            self.config, own, self.device, self.rank, self.profile_run, groups=groups
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate and bind the KV cache, (re)build the persistent batch, capture the graphs and warm
        the sampler. Re-entrant: old state goes."""
        self.graph_runner.drop()  # they read the old cache and buffers
        self.kv_caches = []
        # One block-id space for every stage; this rank holds the memory of its own stage's layers.
        own = kv_cache_sizing.own_kv_cache_config(kv_cache_config, set(self.get_kv_cache_specs()))
        self.kv_caches = kv_cache_sizing.allocate_kv_cache(self._model(), own, self.device)
        kv_heads = max(g.kv_cache_spec.num_kv_heads for g in kv_cache_config.kv_cache_groups)
        lpt_max_seqs = longest_first_max_seqs(kv_heads, num_sms(self.device))
        self.kv_cache_config = kv_cache_config
        self.requests.clear()
        self._in_flight = self._last = None
        self.input_batch = InputBatch(
            self.max_num_reqs,
            self.max_model_len,
            self.max_num_tokens,
            self.device,
            self.pin_memory,
            kv_cache_config.block_sizes,
        )
        self.graph_runner.bind(
            self._model(),
            self.input_batch,
            self.max_model_len,
            kv_cache_config.layer_to_group(),
            lpt_max_seqs,
            self.stage_inputs,
        )
        # The kernels take one block's K or V view (kv_cache[0], kv_cache[1]), whose strides do not hold the
        # block count; it moves a little from start to start with the memory the profile finds free, so only
        # its divisibility by 16 (what Triton specializes an integer on) goes in.
        cache_shape = (kv_cache_config.num_blocks % 16 == 0, kv_cache_config.kv_cache_groups)
        self._compile_ahead(self._warm_up_launches, "buckets", cache_shape, lpt_max_seqs)
        self.graph_runner.capture()
        if not self.is_last_stage:
            return  # only the last stage computes logits and samples
        model = self._model()
        warm_logits(model.compute_logits, int(self._hf("hidden_size")), self.dtype, self.device, self.max_num_reqs)
        self._warm_sampler()

    def _warm_sampler(self) -> None:
        vocab = int(self._hf("vocab_size"))
        warm_sampler(self.sampler, vocab, self.dtype, self.device, self.max_num_reqs, self.sampling_inputs.dummy)

    def _warm_up_launches(self) -> None:
        """What the warm-ups after the KV cache launch, for the dry pass of compile_ahead: every graph
        bucket's step (what capture() warms) and the sampler's variants."""
        self.graph_runner.run_buckets()
        if self.is_last_stage:
            self._warm_sampler()

    def _hf(self, key: str) -> Any:
        return self.hf_config.get(key) if isinstance(self.hf_config, dict) else getattr(self.hf_config, key, None)

    def _model(self) -> DecoderForCausalLM:
        if self.model is None:
            raise RuntimeError("ModelRunner: load_model() must run first")
        return self.model

    def _batch(self) -> InputBatch:
        if self.input_batch is None:
            raise RuntimeError("ModelRunner: initialize_kv_cache() must run before execute_model()")
        return self.input_batch

    # ---- per-step state ---------------------------------------------------------------------
    def _new_state(self, nr: NewRequestData) -> CachedRequestState:
        sp = nr.sampling_params
        state = CachedRequestState(
            req_id=nr.req_id,
            prompt_token_ids=list(nr.prompt_token_ids),
            sampling_params=sp,
            seed=request_seed(sp.seed, self.config.model.seed, nr.req_id),
            block_ids=tuple(list(b) for b in nr.block_ids),
            num_computed_tokens=nr.num_computed_tokens,
            output_token_ids=list(nr.output_token_ids or ()),
        )
        if sp.has_penalties and self.penalty_state is not None:
            state.penalty_slot = self.penalty_state.add(nr.req_id, state.prompt_token_ids, state.output_token_ids)
        if sp.has_logit_row and self.logit_rows is not None:
            state.logit_slot = self.logit_rows.add(nr.req_id, sp)
        if sp.min_tokens:
            # What the scheduler's stop check would end the request on (vLLM's all_stop_token_ids).
            eos = [] if sp.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
            state.min_tokens_ban = list(dict.fromkeys([*sp.stop_token_ids, *eos]))
        return state

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        if self.penalty_state is not None:
            self.penalty_state.remove(req_id)
        if self.logit_rows is not None:
            self.logit_rows.remove(req_id)
        self.logprobs.forget(req_id)

    def _resumed(self, state: CachedRequestState) -> None:
        if state.penalty_slot >= 0 and self.penalty_state is not None:
            # The device counts may hold an in-flight token the scheduler dropped: recount.
            self.penalty_state.add(state.req_id, state.prompt_token_ids, state.output_token_ids)
        self.logprobs.restart_prompt(state.req_id)

    def reset_requests(self) -> None:
        """Forget every request (rows, states, the step in flight): after a step raised, the driver
        re-queues the survivors from scratch and the workers go on with their weights and KV cache."""
        self._batch().remove_all()
        self.requests.clear()
        if self.logit_rows is not None:
            self.logit_rows.clear()  # the survivors come back as new requests and rebuild their rows
        self._in_flight = self._last = None
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def update_states(self, so: SchedulerOutput) -> None:
        self._batch().apply_scheduler_output(so, self.requests, self._new_state, self._forget, self._resumed)
        if so.pipeline_token_ids and not self.is_last_stage:
            self._take_pipeline_tokens(so.pipeline_token_ids)

    def _take_pipeline_tokens(self, tokens: dict[str, list[int]]) -> None:
        """A stage before the last never sampled its requests' tokens: the step brings the ones it
        computes past each prompt; they go into the request's state and its row."""
        batch = self._batch()
        for rid, ids in tokens.items():
            state = self.requests[rid]
            prompt_len = len(state.prompt_token_ids)
            start = max(state.num_computed_tokens, prompt_len)
            outs = state.output_token_ids
            del outs[start - prompt_len :]  # positions from `start` on are this step's, as the step says
            outs.extend(ids)
            row = batch.req_id_to_index[rid]
            end = start + len(ids)
            batch.token_ids_cpu[row, start:end] = ids
            batch.num_tokens[row] = max(int(batch.num_tokens[row]), end)

    # ---- the step: prepare -> launch -> complete -----------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step; return its output (rank 0), or with lag_outputs the previous step's (None if
        there was none). An empty step launches nothing and, lagging, returns what was in flight."""
        timer = self.step_timer
        if timer is not None:
            timer.mark("enter")
        if self._copies_done is not None:
            self._copies_done.synchronize()  # normally long done; guards the pinned buffers
            self._copies_done = None
        self.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            previous, self._in_flight = self._in_flight, None
            if previous is not None:
                return self._complete(previous)
            return None if self.lag_outputs or not self.answers else ModelRunnerOutput([], [], step_id=so.step_id)
        step: SampledStep | None = self._launch(so, self._prepare(so))
        self._last = step
        if timer is not None:
            timer.mark("launched")
        if self.lag_outputs:
            step, self._in_flight = self._in_flight, step
        out = None if step is None else self._complete(step)
        if timer is not None:
            timer.mark("exit")
        return out

    def _prepare(self, so: SchedulerOutput) -> StagedStep:
        """Commit the block table and stage the step's record (O(rows) host work; no sync)."""
        batch = self._batch()
        num_reqs = batch.num_reqs
        batch.block_table.commit_block_table(num_reqs)  # first: the DMA overlaps the CPU work below
        # map() with the bound __getitem__ looks the rows up in C: no generator frame per request.
        num_sched = np.fromiter(map(so.num_scheduled_tokens.__getitem__, batch.req_ids), dtype=np.int64, count=num_reqs)
        computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
        feed = (
            self._last.feed_index(batch.req_ids, computed)
            if self._last is not None
            else np.full(num_reqs, -1, dtype=np.int64)
        )
        staged = self.stager.stage_step(num_sched, computed, batch.num_tokens[:num_reqs], feed, batch.token_ids_cpu)
        rows = staged.sample_rows
        if not self.is_last_stage:
            rows = staged.sample_rows = rows[:0]  # only the last stage samples
        # Sampling parameters of the sampling rows (their output position: what Philox is keyed by) and
        # the prompt positions whose logprobs this step scores.
        out_pos = staged.seq_lens[rows] - batch.num_prompt_tokens[rows]
        last = (self.stager.out.input_ids, self.stager.out.logits_indices)  # read after the inputs are built
        staged.sampling = self.sampling_inputs.build(batch, rows, out_pos, last) if len(rows) else None
        if self.is_last_stage:
            staged.prompt_plan = prompt_plan(
                batch, num_reqs, computed, num_sched, np.cumsum(num_sched) - num_sched, self.logprobs.done
            )
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        if staged.num_tokens != so.total_num_scheduled_tokens:
            raise RuntimeError(
                f"step {so.step_id}: num_scheduled_tokens sums to {staged.num_tokens} but "
                f"total_num_scheduled_tokens is {so.total_num_scheduled_tokens}"
            )
        if staged.num_tokens > self.max_num_tokens:
            raise RuntimeError(
                f"step schedules {staged.num_tokens} tokens > max_num_batched_tokens={self.max_num_tokens}"
            )
        return staged

    def _launch(self, so: SchedulerOutput, staged: StagedStep) -> SampledStep:
        """Queue the step's GPU work and the copy of its sampled tokens to the host; no host sync."""
        batch = self._batch()
        if self.step_timer is not None:
            self.step_timer.begin(batch.num_reqs, so.total_num_scheduled_tokens, int(staged.seq_lens.sum()))
        if self.stage_inputs is not None:
            # A later stage: the previous stage's activations for this step's tokens, into fixed buffers.
            parallel_state.recv_from_prev_stage(self.stage_inputs.narrow(staged.num_tokens).tensors())
        if not self.is_last_stage:
            parallel_state.wait_for_sends()  # the last step's activations left: their buffers are free again
        result, graph = self.graph_runner.run(staged)
        if isinstance(result, StageActivations):
            parallel_state.send_to_next_stage(result.narrow(staged.num_tokens).tensors())
            if self.step_timer is not None:
                self.step_timer.end()
            return self.readback.start(so.step_id, batch.req_ids, [], staged.sample_rows, None, graph=graph)
        hidden = result
        tokens = sample_lp = prompt_lp = None
        rows = staged.sample_rows
        if staged.sampling is not None:
            logits = self._model().compute_logits(hidden[self.stager.out.logits_indices[: len(rows)]])
            sampled = self.sampler(logits, staged.sampling)
            tokens, sample_lp = sampled.token_ids, sampled.logprobs
            self.stager.keep_sampled(tokens)
        if staged.prompt_plan is not None:
            prompt_lp = compute_prompt_logprobs(
                self._model().compute_logits, hidden, staged.prompt_plan, self.sampler.use_triton
            )
        step_lp = launch_copies(
            sample_lp,
            None if sample_lp is None else batch.num_logprobs[rows],
            prompt_lp,
            staged.prompt_plan,
            self.device.type == "cuda",
        )
        if self.step_timer is not None:
            self.step_timer.end()  # also for a step that samples nothing, or its begin stays unpaired
        req_ids = batch.req_ids
        states = list(map(self.requests.__getitem__, req_ids))
        step = self.readback.start(
            so.step_id, req_ids, states, rows, tokens, sample_positions=staged.seq_lens[rows], graph=graph
        )
        step.logprobs = step_lp
        return step

    def _complete(self, step: SampledStep) -> ModelRunnerOutput | None:
        """Wait for the step's tokens and record them. Lagging, the batch may have changed since the
        step ran (rows moved, requests gone): tokens go to the rows and states of the same live requests."""
        sampled = step.tokens()  # the host sync: with lag_outputs the next step is queued already
        if self.step_timer is not None:
            self.step_timer.mark("tokens")
        out_tokens: list[list[int]] = [[] for _ in step.req_ids]
        if sampled:
            batch = self._batch()
            requests = self.requests
            rows_now = np.full(len(sampled), -1, dtype=np.int64)
            for i, (row, token) in enumerate(zip(step.sample_rows.tolist(), sampled, strict=True)):
                state = step.states[row]
                out_tokens[row] = [token]
                if state.req_id in requests and requests[state.req_id] is state:  # not gone, id not reused
                    state.output_token_ids.append(token)
                    rows_now[i] = batch.req_id_to_index.get(state.req_id, -1)
            live = rows_now >= 0
            batch.append_tokens(rows_now[live], np.asarray(sampled)[live])
        if not self.answers:
            return None
        logprobs, prompt_logprobs = self.logprobs.collect(step.logprobs, step.req_ids, step.sample_rows)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=out_tokens,
            step_id=step.step_id,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cudagraph=step.graph,
        )
