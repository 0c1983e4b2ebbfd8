"""The model runner: one rank's model, paged KV cache and persistent batch.

Each step it applies the scheduler's deltas to the InputBatch, builds the step's inputs on pinned host
buffers (copied non-blocking, no host synchronisation until the sampled tokens are read back), runs
the forward under the step's attention metadata, samples, and remembers the tokens it sampled: the
scheduler never sends them back. With async scheduling it answers each step with the previous step's
output: step N+1 is launched (its inputs fed step N's tokens on the device) before step N's tokens are
read back, so the host work of both steps overlaps the GPU's.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actors import parallel_state
from actors.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes
from actors.forward_context import (
    AttentionMetadata,
    ForwardContext,
    set_forward_context,
)
from actors.input_batch import CachedRequestState, InputBatch
from actors.logprobs import MAX_LOGPROBS
from actors.penalty_state import PenaltyState
from actors.sampler import Sampler, SamplingMetadata, request_seed
from actors.sampling_inputs import SamplingInputs
from actors.step_logprobs import (
    LogprobsCollector,
    PromptPlan,
    compute_prompt_logprobs,
    launch_copies,
    prompt_plan,
)
from actors.step_profiler import StepTimer
from actors.token_readback import SampledStep, TokenReadback
from actors.engine_config import EngineConfig
from kvcore.buffers import CpuGpuBuffer
from kvcore.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvcore.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    group_layers_by_spec,
    num_blocks_for_budget,
)

logger = logging.getLogger(__name__)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in ("torch", "triton"):
        raise ValueError(f"model.attention_backend={name!r}: must be auto, torch or triton")
    return name


def resolve_max_model_len(configured: int | None, hf_config: Any) -> int:
    """The configured limit, else the model's max_position_embeddings; never above the latter."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    model_max = get("max_position_embeddings", None)
    if configured is None:
        if model_max is None:
            raise ValueError("model.max_model_len: the model config has no max_position_embeddings; set it")
        return int(model_max)
    if configured < 1:
        raise ValueError(f"model.max_model_len={configured}: must be >= 1")
    if model_max is not None and configured > model_max:
        raise ValueError(f"model.max_model_len={configured}: exceeds the model's "
                         f"max_position_embeddings={model_max}")
    return int(configured)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: dict[int, AttentionMetadata]
    logits_indices: torch.Tensor
    sample_rows: np.ndarray          # rows whose prefill completes this step (they sample)
    sampling: SamplingMetadata | None  # for the sample rows, already on the device
    num_scheduled: np.ndarray        # tokens scheduled per row 0..num_reqs-1 (int64)
    graph_size: int | None = None    # a decode batch padded to this bucket (replayable), else None
    prompt_plan: PromptPlan | None = None  # prompt positions whose logprobs this step computes


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, rank: int) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        self.backend = resolve_attention_backend(config.model.attention_backend, device)
        self.pin_memory = device.type == "cuda"
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.model: torch.nn.Module | None = None
        self.hf_config: Any = None
        self.max_model_len = 0
        self.dtype = torch.float32
        self.sampler = Sampler()
        self.penalty_state: PenaltyState | None = None  # built with the model (it needs the vocabulary)
        self.logprobs = LogprobsCollector()
        self.eos_token_id: int | None = None
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch: InputBatch | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.layer_to_group: dict[str, int] = {}
        self.slot_mappings_by_gid: dict[int, torch.Tensor] = {}
        self.slot_mappings_by_layer: dict[str, torch.Tensor] = {}
        # Marks the end of a step's host-to-device copies: the next step waits on it before editing the
        # pinned sources again (a step that samples nothing has no other synchronisation point).
        self._copies_done: torch.cuda.Event | None = None
        # Decode batches are padded to these sizes when graphs are captured (see actors/cuda_graphs.py).
        # Tests set _pad_decode_to_bucket on the CPU to run the padded inputs eagerly.
        self.cudagraph_sizes = capture_sizes(min(self.max_num_reqs, self.max_num_tokens))
        self.graphs: DecodeGraphs | None = None
        self._pad_decode_to_bucket = False
        self.step_timer: StepTimer | None = None  # set by the GPU idle benchmark (Worker.start_step_timing)
        self.lag_outputs = config.scheduler.async_scheduling
        self.readback = TokenReadback(self.max_num_reqs, device, self.pin_memory)
        self._in_flight: SampledStep | None = None  # lag mode: launched, output not yet returned
        self._make_step_buffers()

    def _make_step_buffers(self) -> None:
        kw = dict(device=self.device, pin_memory=self.pin_memory)
        self.input_ids = CpuGpuBuffer(self.max_num_tokens, dtype=torch.int64, **kw)
        self.positions = CpuGpuBuffer(self.max_num_tokens, dtype=torch.int64, **kw)
        self.query_start_loc = CpuGpuBuffer(self.max_num_reqs + 1, dtype=torch.int32, **kw)
        self.seq_lens = CpuGpuBuffer(self.max_num_reqs, dtype=torch.int32, **kw)
        self.logits_indices = CpuGpuBuffer(self.max_num_reqs, dtype=torch.int64, **kw)
        self.sampling_inputs = SamplingInputs(self.max_num_reqs, self.device, self.pin_memory)
        self.feed_dst = CpuGpuBuffer(self.max_num_reqs, dtype=torch.int64, **kw)
        self.feed_src = CpuGpuBuffer(self.max_num_reqs, dtype=torch.int64, **kw)
        self._arange = np.arange(max(self.max_num_tokens, self.max_num_reqs) + 1, dtype=np.int64)

    # ---- model and KV cache -----------------------------------------------------------------
    def load_model(self) -> None:
        from actors.loader import (
            load_model,  # the loader pulls in the model zoo; only workers need it
        )
        self.model, self.hf_config = load_model(self.config.model.model, dtype=self.config.model.dtype,
                                                attention_backend=self.backend, device=self.device)
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = resolve_max_model_len(self.config.model.max_model_len, self.hf_config)
        get = self.hf_config.get if isinstance(self.hf_config, dict) else lambda k: getattr(self.hf_config, k, None)
        eos = get("eos_token_id")
        self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos  # as the driver's stop check
        self.penalty_state = PenaltyState(int(get("vocab_size")), self.device)
        self.sampler = Sampler(self.penalty_state)

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        specs: dict[str, KVCacheSpec] = {}
        block_size = self.config.cache.block_size
        for layer in self._model().attention_layers():
            kw = dict(block_size=block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                      dtype=self.dtype)
            hybrid = layer.sliding_window and not self.config.cache.disable_hybrid_kv_cache_manager
            specs[layer.layer_name] = (SlidingWindowSpec(**kw, sliding_window=layer.sliding_window)
                                       if hybrid else FullAttentionSpec(**kw))
        return specs

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward of max_num_batched_tokens tokens and logits for max_num_seqs rows, with no KV cache,
        so the peak activation memory is what a real step can reach."""
        model = self._model()
        n = self.max_num_tokens
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, dtype=torch.int64, device=self.device) % max(self.max_model_len, 1)
        with set_forward_context(ForwardContext(attn_metadata=None, layer_to_group={})):
            hidden = model(ids, pos)
        rows = min(self.max_num_reqs, n)
        logits = model.compute_logits(hidden[:rows])
        del hidden
        if self.device.type == "cuda":
            # The step's logprobs (a vocabulary-wide log_softmax and top-k) are part of its peak; the
            # sampling kernel itself allocates nothing. (The CPU budget is configured, not profiled.)
            ones = torch.ones(rows, device=self.device)
            ids = torch.zeros(rows, dtype=torch.int64, device=self.device)
            # Both kernel variants of plain requests compile here, not on the first request that needs one.
            for need_filter in (False, True):
                self.sampler(logits, SamplingMetadata(
                    temperature=ones, top_k=ids.to(torch.int32) + 8, top_p=ones * 0.9, seeds=ids, positions=ids,
                    all_greedy=False, need_filter=need_filter, num_logprobs=MAX_LOGPROBS))

    def determine_num_blocks(self) -> int:
        """Blocks this rank can hold: the override, else the memory budget left after a profile run."""
        groups = group_layers_by_spec(self.get_kv_cache_specs())
        if self.config.cache.num_gpu_blocks is not None:
            return int(self.config.cache.num_gpu_blocks)
        if self.device.type != "cuda":
            self.profile_run()
            return num_blocks_for_budget(groups, int(self.config.cache.cpu_kv_cache_gib * 2**30))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        share = self.config.parallel.gpus_per_worker
        used = torch.cuda.max_memory_allocated(self.device)
        if share >= 1.0:
            # Memory held by others (other processes, the CUDA context, NCCL) is outside torch's counters.
            used += max((total - free) - torch.cuda.memory_reserved(self.device), 0)
        # Ranks sharing the GPU size their caches at the same time: each takes its share of the budget
        # and counts only its own tensors (what the others hold is theirs; the CUDA contexts come out
        # of the 1 - gpu_memory_utilization headroom).
        budget = int(total * self.config.cache.gpu_memory_utilization * min(share, 1.0)) - used
        torch.cuda.empty_cache()
        logger.info("rank %d: KV budget %.2f GiB (total %.2f, peak used %.2f)", self.rank, budget / 2**30,
                    total / 2**30, used / 2**30)
        return num_blocks_for_budget(groups, budget)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate one memory tensor per layer slot (shared by the i-th layer of every group), bind each
        attention layer's view of it, and (re)build the persistent batch. Re-entrant: old state goes."""
        layers = {layer.layer_name: layer for layer in self._model().attention_layers()}
        slots = kv_cache_config.layer_to_slot()
        missing = sorted(set(layers) ^ set(slots))
        if missing:
            raise ValueError(f"KVCacheConfig and model disagree on attention layers: {missing}")
        self._drop_graphs()  # they read the old cache and buffers
        for layer in layers.values():
            layer.kv_cache = None
        self.kv_caches = []
        num_blocks = kv_cache_config.num_blocks
        page_bytes = {g.kv_cache_spec.page_size_bytes for g in kv_cache_config.kv_cache_groups}
        if len(page_bytes) != 1:
            raise ValueError(f"KV-cache groups must share one page size; got {sorted(page_bytes)}")
        slot_bytes = num_blocks * page_bytes.pop()
        # Zeroed so unwritten pages hold finite values even where a kernel reads and then masks them.
        self.kv_caches = [torch.zeros(slot_bytes, dtype=torch.uint8, device=self.device)
                          for _ in range(kv_cache_config.num_memory_slots)]
        for group in kv_cache_config.kv_cache_groups:
            s = group.kv_cache_spec
            shape = (2, num_blocks, s.block_size, s.num_kv_heads, s.head_size)
            for name in group.layer_names:
                layers[name].kv_cache = self.kv_caches[slots[name]].view(s.dtype).view(shape)
        self.kv_cache_config = kv_cache_config
        self.layer_to_group = kv_cache_config.layer_to_group()
        self.requests.clear()
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_tokens,
                                      self.device, self.pin_memory, kv_cache_config.block_sizes)
        self.capture_decode_graphs()

    # ---- CUDA graphs ------------------------------------------------------------------------
    def _graphs_unavailable(self) -> str | None:
        if self.device.type != "cuda":
            return "not on a GPU"
        if self.config.model.enforce_eager:
            return "model.enforce_eager is set"
        if self.backend != "triton":
            return f"attention backend {self.backend!r} reads host values (only 'triton' is capturable)"
        if parallel_state.tp_size() > 1 and self.config.parallel.collective_backend != "nccl":
            return "tensor-parallel collectives over gloo cannot be captured (NCCL can)"
        return None

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture one decode graph per bucket on the buffers of the current persistent batch. Every
        rank must agree: a TP group where one rank replays and another runs eagerly still matches
        collective for collective, but a rank that failed mid-capture is safer eager everywhere."""
        self._drop_graphs()
        reason = self._graphs_unavailable()
        if reason is not None:
            logger.info("rank %d: CUDA graphs off: %s", self.rank, reason)
            return
        t0 = time.perf_counter()
        graphs = DecodeGraphs(self.cudagraph_sizes, self.device)
        ok = graphs.capture(self._prepare_dummy_decode, self._static_decode_forward)
        if parallel_state.tp_size() > 1:
            ok = parallel_state.all_reduce_min(int(ok)) == 1
        self._prepare_dummy_decode(0)  # leave no dummy slot mapping behind
        if not ok:
            graphs.clear()
            return
        self.graphs = graphs
        self._pad_decode_to_bucket = True
        logger.info("rank %d: captured %d decode CUDA graphs (batch sizes %s) in %.1f s", self.rank,
                    len(graphs.captured_sizes), graphs.captured_sizes, time.perf_counter() - t0)

    def _drop_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        self.graphs = None
        self._pad_decode_to_bucket = False

    def _prepare_dummy_decode(self, size: int) -> None:
        """A decode batch of `size` padding rows in the static buffers; every slot -1 (no KV write)."""
        self._pad_rows(0, size)
        self.query_start_loc.np[0] = 0
        self.input_ids.copy_to_gpu(size)
        self.positions.copy_to_gpu(size)
        self.query_start_loc.copy_to_gpu(size + 1)
        self.seq_lens.copy_to_gpu(size)
        for table in self._batch().block_table.block_tables:
            table.slot_mapping.gpu.fill_(-1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pinned sources are rewritten by the next size

    def _static_decode_forward(self, size: int) -> torch.Tensor:
        ctx = ForwardContext(attn_metadata=self._decode_metadata(size), layer_to_group=self.layer_to_group)
        with set_forward_context(ctx):
            return self._model()(self.input_ids.gpu[:size], self.positions.gpu[:size])

    def _decode_metadata(self, size: int) -> dict[int, AttentionMetadata]:
        """Metadata of a padded decode batch of `size` rows: views of the static buffers, and host ints
        that hold for any such batch (so a graph captured with them is valid at every replay)."""
        batch = self._batch()
        qsl = self.query_start_loc.gpu[:size + 1]
        seq_lens = self.seq_lens.gpu[:size]
        return {gid: AttentionMetadata(
            num_actual_tokens=size, num_reqs=size, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc=qsl, seq_lens=seq_lens, block_table=table.block_table.gpu[:size],
            slot_mapping=table.slot_mapping.gpu[:size])
            for gid, table in enumerate(batch.block_table.block_tables)}

    def _pad_rows(self, num_reqs: int, size: int) -> None:
        """Rows [num_reqs, size) of the host buffers as padding: one token 0 at position 0, seq_len 1
        (reads one KV position of a valid block; its slot is -1, so it writes nothing)."""
        self.input_ids.np[num_reqs:size] = 0
        self.positions.np[num_reqs:size] = 0
        self.seq_lens.np[num_reqs:size] = 1
        start = int(self.query_start_loc.np[num_reqs]) if num_reqs else 0
        self.query_start_loc.np[num_reqs + 1:size + 1] = start + self._arange[1:size - num_reqs + 1]

    def _decode_bucket(self, num_reqs: int, total: int, max_query_len: int) -> int | None:
        """The bucket a decode-only batch is padded to, or None (mixed batch, too large, no graph).
        Decode-only means every row runs exactly one token: total == num_reqs alone would also pass
        rows of 0 and 2 tokens, which a graph captured with max_query_len 1 computes wrongly."""
        if not self._pad_decode_to_bucket or total != num_reqs or max_query_len != 1:
            return None
        size = bucket_for(num_reqs, self.cudagraph_sizes)
        if size is None or (self.graphs is not None and size not in self.graphs):
            return None
        return size

    def _model(self) -> torch.nn.Module:
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
        state = CachedRequestState(req_id=nr.req_id, prompt_token_ids=list(nr.prompt_token_ids),
                                   sampling_params=sp, seed=request_seed(sp.seed, self.config.model.seed, nr.req_id),
                                   block_ids=tuple(list(b) for b in nr.block_ids),
                                   num_computed_tokens=nr.num_computed_tokens)
        if sp.has_penalties and self.penalty_state is not None:
            state.penalty_slot = self.penalty_state.add(nr.req_id, state.prompt_token_ids, [])
        if sp.min_tokens:
            # What the scheduler's stop check would end the request on (vLLM's all_stop_token_ids).
            eos = [] if sp.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
            state.min_tokens_ban = list(dict.fromkeys([*sp.stop_token_ids, *eos]))
        return state

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        if self.penalty_state is not None:
            self.penalty_state.remove(req_id)
        self.logprobs.forget(req_id)

    def reset_requests(self) -> None:
        """Forget every request (rows, states, the step in flight): after a step raised, the driver
        re-queues the survivors from scratch and the workers go on with their weights and KV cache."""
        batch = self._batch()
        for req_id in list(batch.req_id_to_index):
            batch.remove_request(req_id)
        batch.condense()
        self.requests.clear()
        self._in_flight = None
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def update_states(self, so: SchedulerOutput) -> None:
        batch = self._batch()
        for req_id in so.finished_req_ids:
            self._forget(req_id)
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)  # its state stays: it comes back resumed
        # Rows of requests not scheduled this step go; their state (tokens, blocks) stays cached. The
        # key-view subset test runs in C and is true on most steps, skipping the per-request scan.
        if not batch.req_id_to_index.keys() <= so.num_scheduled_tokens.keys():
            for req_id in [r for r in batch.req_id_to_index if r not in so.num_scheduled_tokens]:
                batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for nr in so.scheduled_new_reqs:
            state = self._new_state(nr)
            self.requests[nr.req_id] = state
            to_add.append(state)
        self._update_cached(so, batch, to_add)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        if batch.num_reqs != len(so.num_scheduled_tokens):
            raise RuntimeError(f"runner batch has {batch.num_reqs} requests but the step schedules "
                               f"{len(so.num_scheduled_tokens)}")

    def _update_cached(self, so: SchedulerOutput, batch: InputBatch, to_add: list[CachedRequestState]) -> None:
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                raise RuntimeError(f"step {so.step_id}: cached request {req_id!r} is unknown to this worker")
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                tokens = cached.resumed_token_ids[i]
                assert new_ids is not None and tokens is not None, "a resumed request carries blocks and tokens"
                state.block_ids = tuple(list(b) for b in new_ids)
                state.output_token_ids = list(tokens[len(state.prompt_token_ids):])
                if state.penalty_slot >= 0 and self.penalty_state is not None:
                    # The device counts may hold an in-flight token the scheduler dropped: recount.
                    self.penalty_state.add(req_id, state.prompt_token_ids, state.output_token_ids)
                self.logprobs.restart_prompt(req_id)
                batch.remove_request(req_id)
                to_add.append(state)
                continue
            if new_ids is not None:
                for blocks, delta in zip(state.block_ids, new_ids):
                    blocks.extend(delta)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)  # back after an unscheduled step: the full row is rebuilt
                continue
            batch.num_computed_tokens[row] = state.num_computed_tokens
            if new_ids is not None:
                batch.block_table.append_row(new_ids, row)

    # ---- inputs -----------------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self._batch()
        num_reqs = batch.num_reqs
        batch.block_table.commit_block_table(num_reqs)  # first: the DMA overlaps the CPU work below

        # map() with the bound __getitem__ looks the rows up in C: no generator frame per request.
        num_sched = np.fromiter(map(so.num_scheduled_tokens.__getitem__, batch.req_ids), dtype=np.int64,
                                count=num_reqs)
        cu = np.cumsum(num_sched)
        total = int(cu[-1]) if num_reqs else 0
        if total != so.total_num_scheduled_tokens:
            raise RuntimeError(f"step {so.step_id}: num_scheduled_tokens sums to {total} but "
                               f"total_num_scheduled_tokens is {so.total_num_scheduled_tokens}")
        if total > self.max_num_tokens:
            raise RuntimeError(f"step schedules {total} tokens > max_num_batched_tokens={self.max_num_tokens}")
        req_idx = np.repeat(self._arange[:num_reqs], num_sched)
        offsets = self._arange[:total] - np.repeat(cu - num_sched, num_sched)
        computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
        positions = computed[req_idx] + offsets
        self.input_ids.np[:total] = batch.token_ids_cpu.reshape(-1)[positions + req_idx * batch.max_model_len]
        self.positions.np[:total] = positions
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:num_reqs + 1] = cu
        seq_lens = computed + num_sched
        self.seq_lens.np[:num_reqs] = seq_lens
        # Requests whose known tokens are all in the cache after this step sample; partial prefills do not.
        sample_rows = np.nonzero(seq_lens >= batch.num_tokens[:num_reqs])[0]
        self.logits_indices.np[:len(sample_rows)] = cu[sample_rows] - 1
        max_query_len = int(num_sched.max())
        pad = self._decode_bucket(num_reqs, total, max_query_len)
        num_tokens, num_rows = total, num_reqs
        if pad is not None:
            self._pad_rows(num_reqs, pad)
            num_tokens = num_rows = pad

        input_ids = self.input_ids.copy_to_gpu(num_tokens)
        if self._in_flight is not None and self._in_flight.device_tokens is not None:
            self._feed_in_flight_tokens(batch.req_ids, cu - num_sched, input_ids)
        positions_dev = self.positions.copy_to_gpu(num_tokens)
        qsl = self.query_start_loc.copy_to_gpu(num_rows + 1)
        seq_lens_dev = self.seq_lens.copy_to_gpu(num_rows)
        logits_indices = self.logits_indices.copy_to_gpu(len(sample_rows))
        # Before the event below: the next step may rewrite these pinned sources once it has passed.
        sampling = (self.sampling_inputs.build(batch, sample_rows,
                                               seq_lens[sample_rows] - batch.num_prompt_tokens[sample_rows])
                    if len(sample_rows) else None)
        plan = prompt_plan(batch, num_reqs, computed, num_sched, cu - num_sched, self.logprobs.done)
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()

        # With the real request count: padding tokens (beyond query_start_loc[num_reqs]) get slot -1.
        batch.block_table.compute_slot_mapping(num_reqs, qsl, positions_dev)
        if pad is not None:
            attn_metadata = self._decode_metadata(pad)
        else:
            max_seq_len = int(seq_lens.max())
            attn_metadata = {gid: AttentionMetadata(
                num_actual_tokens=total, num_reqs=num_reqs, max_query_len=max_query_len,
                max_seq_len=max_seq_len, query_start_loc=qsl, seq_lens=seq_lens_dev,
                block_table=table.block_table.gpu[:num_reqs], slot_mapping=table.slot_mapping.gpu[:total])
                for gid, table in enumerate(batch.block_table.block_tables)}
        # Both views share each group's one buffer: attention metadata reads by group, layers by name.
        self.slot_mappings_by_gid = {gid: md.slot_mapping for gid, md in attn_metadata.items()}
        self.slot_mappings_by_layer = {name: self.slot_mappings_by_gid[gid]
                                       for name, gid in self.layer_to_group.items()}
        return StepInputs(input_ids, positions_dev, attn_metadata, logits_indices, sample_rows, sampling,
                          num_sched, pad, plan)

    def _feed_in_flight_tokens(self, req_ids: list[str], starts: np.ndarray, input_ids: torch.Tensor) -> None:
        """Rows that sampled in the step still in flight start this step with that token, which only the
        device has yet: copy it from the sampler's output into input_ids (two small kernels)."""
        src = self._in_flight.feed_index(req_ids)
        rows = np.flatnonzero(src >= 0)
        k = len(rows)
        if not k:
            return
        self.feed_dst.np[:k] = starts[rows]
        self.feed_src.np[:k] = src[rows]
        dst = self.feed_dst.copy_to_gpu(k)
        tokens = self._in_flight.device_tokens.index_select(0, self.feed_src.copy_to_gpu(k))
        input_ids.index_copy_(0, dst, tokens)

    # ---- the step ---------------------------------------------------------------------------
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
            return None if self.lag_outputs or self.rank != 0 else ModelRunnerOutput([], [], step_id=so.step_id)
        step = self._launch(so)
        if timer is not None:
            timer.mark("launched")
        if self.lag_outputs:
            step, self._in_flight = self._in_flight, step
        out = None if step is None else self._complete(step)
        if timer is not None:
            timer.mark("exit")
        return out

    def _launch(self, so: SchedulerOutput) -> SampledStep:
        """Queue the step's GPU work and the copy of its sampled tokens to the host; no host sync."""
        batch = self._batch()
        inputs = self._prepare_inputs(so)
        if self.step_timer is not None:
            self.step_timer.begin(batch.num_reqs, so.total_num_scheduled_tokens)
        if inputs.graph_size is not None and self.graphs is not None:
            # The commit and the slot mapping above ran on this stream: the replay sees them.
            hidden = self.graphs.replay(inputs.graph_size)
        else:
            ctx = ForwardContext(attn_metadata=inputs.attn_metadata, layer_to_group=self.layer_to_group)
            with set_forward_context(ctx):
                hidden = self._model()(inputs.input_ids, inputs.positions)
        tokens = sample_lp = prompt_lp = None
        if inputs.sampling is not None:
            logits = self._model().compute_logits(hidden[inputs.logits_indices])
            sampled = self.sampler(logits, inputs.sampling)
            tokens, sample_lp = sampled.token_ids, sampled.logprobs
        if inputs.prompt_plan is not None:
            prompt_lp = compute_prompt_logprobs(self._model().compute_logits, hidden, inputs.prompt_plan)
        step_lp = launch_copies(sample_lp, None if sample_lp is None else batch.num_logprobs[inputs.sample_rows],
                                prompt_lp, inputs.prompt_plan, self.device.type == "cuda")
        if self.step_timer is not None:
            self.step_timer.end()  # also for a step that samples nothing, or its begin stays unpaired
        req_ids = batch.req_ids
        states = list(map(self.requests.__getitem__, req_ids))
        step = self.readback.start(so.step_id, req_ids, states, inputs.sample_rows, tokens,
                                   index_for_feed=self.lag_outputs)
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
            for i, (row, token) in enumerate(zip(step.sample_rows.tolist(), sampled)):
                state = step.states[row]
                out_tokens[row] = [token]
                if requests.get(state.req_id) is state:
                    state.output_token_ids.append(token)
                    rows_now[i] = batch.req_id_to_index.get(state.req_id, -1)
            live = rows_now >= 0
            batch.append_tokens(rows_now[live], np.asarray(sampled)[live])
        if self.rank != 0:
            return None
        logprobs, prompt_logprobs = self.logprobs.collect(step.logprobs, step.req_ids, step.sample_rows)
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=out_tokens, step_id=step.step_id,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs)
