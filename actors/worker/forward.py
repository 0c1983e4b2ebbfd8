"""The model runner's forward pass and its CUDA graphs (GraphRunner, held by ModelRunner,
actors/worker/model_runner.py): one graph per bucket captured at start-up when every rank can, the step
replayed from its bucket's graph or run eagerly on the same static buffers, and why a step ran eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from actors import parallel_state
from actors.config.engine import EngineConfig
from actors.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from actors.input_batch import InputBatch
from actors.models.stage import StageActivations
from actors.worker.cuda_graphs import Bucket, BucketPlan, GraphStats, StepGraphs
from actors.worker.input_prep import InputStager, StagedStep
from kvcore.kernels.ops import longest_first

if TYPE_CHECKING:  # the model zoo is imported only where a model is loaded
    from actors.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


class GraphRunner:
    """One rank's step forward: its bucket plan, its captured graphs and the count of eager steps.
    Built with the runner; `bind` hands it the loaded model and the batch of the bound KV cache."""

    def __init__(
        self, config: EngineConfig, device: torch.device, rank: int, backend: str, stager: InputStager
    ) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        self.backend = backend
        self.stager = stager
        mode = "none" if config.model.enforce_eager else config.model.cudagraph_mode
        self.plan = BucketPlan(
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            mode,
            config.model.cudagraph_max_tokens,
        )
        self.graphs: StepGraphs | None = None
        self.graph_stats = GraphStats()
        # Tests set this on the CPU to run the padded bucket inputs eagerly (what a replay computes).
        self.pad_to_buckets = False
        # Set by bind(): what the step runs on.
        self.model: DecoderForCausalLM | None = None
        self.batch: InputBatch | None = None
        self.max_model_len = 0
        self.layer_to_group: dict[str, int] = {}
        self.lpt_max_seqs = 0  # see attention_tiles.longest_first_max_seqs; set with the KV cache
        self.stage_inputs: StageActivations | None = None  # a later pipeline stage's receive buffers

    def bind(
        self,
        model: DecoderForCausalLM,
        batch: InputBatch,
        max_model_len: int,
        layer_to_group: dict[str, int],
        lpt_max_seqs: int,
        stage_inputs: StageActivations | None,
    ) -> None:
        """What the step runs on: the model, the persistent batch of the bound KV cache and its layout."""
        self.model = model
        self.batch = batch
        self.max_model_len = max_model_len
        self.layer_to_group = layer_to_group
        self.lpt_max_seqs = lpt_max_seqs
        self.stage_inputs = stage_inputs

    def _model(self) -> DecoderForCausalLM:
        if self.model is None:
            raise RuntimeError("GraphRunner: bind() must run first")
        return self.model

    def _batch(self) -> InputBatch:
        if self.batch is None:
            raise RuntimeError("GraphRunner: bind() must run first")
        return self.batch

    def graphs_unavailable(self) -> str | None:
        """Why this rank captures no graphs (None: it can). Public: a CPU test stubs it to drive capture."""
        if self.device.type != "cuda":
            return "not on a GPU"
        if self.plan.mode == "none":
            return "model.enforce_eager is set" if self.config.model.enforce_eager else "cudagraph_mode is none"
        if self.backend != "triton":
            return f"attention backend {self.backend!r} reads host values (only 'triton' is capturable)"
        if parallel_state.tp_size() > 1 and self.config.parallel.collective_backend != "nccl":
            return "tensor-parallel collectives over gloo cannot be captured (NCCL can)"
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket. Every rank must agree: a rank that failed mid-capture makes
        every rank eager (a TP group where one rank replays and another does not still matches
        collective for collective, but eager everywhere is the safe side)."""
        self.drop()
        reason = self.graphs_unavailable()
        if reason is not None:
            logger.info("rank %d: CUDA graphs off: %s", self.rank, reason)
            return
        t0 = time.perf_counter()
        graphs = StepGraphs(self.device)
        buckets = self.plan.buckets()
        ok = graphs.capture(buckets, self._stage_dummy, self._bucket_forward)
        if parallel_state.tp_size() > 1:
            ok = parallel_state.all_reduce_min(int(ok)) == 1
        if not ok:
            graphs.clear()
            return
        self.graphs = graphs
        logger.info(
            "rank %d: captured %d CUDA graphs (decode batch sizes %s, mixed token counts %s) in %.1f s",
            self.rank,
            len(buckets),
            self.plan.decode_sizes,
            self.plan.token_sizes,
            time.perf_counter() - t0,
        )

    def run_buckets(self) -> None:
        """Every bucket's step once, eagerly on a dummy step, as capture() warms them up before capturing
        (a rank that captures no graphs runs none): compile_ahead's dry pass of the capture."""
        if self.graphs_unavailable() is not None:
            return
        for bucket in self.plan.buckets():
            self._stage_dummy(bucket)
            self._bucket_forward(bucket)

    def drop(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        self.graphs = None

    def _stage_dummy(self, bucket: Bucket) -> None:
        """A step of no rows: every token is padding (slot -1), so warm-up and capture write no KV."""
        empty = np.zeros(0, dtype=np.int64)
        self.stager.stage_step(empty, empty, empty, empty, self._batch().token_ids_cpu)

    def _bucket_forward(self, bucket: Bucket) -> torch.Tensor | StageActivations:
        return self._forward(bucket.num_seqs, bucket.num_tokens, bucket.max_query_len, self.max_model_len)

    def _forward(
        self, num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int
    ) -> torch.Tensor | StageActivations:
        """The step on the static buffers: input kernels, slot mapping, model; hidden states."""
        batch = self._batch()
        self.stager.build(num_seqs, num_tokens)
        out = self.stager.out
        qsl = out.query_start_loc[: num_seqs + 1]
        positions = out.positions[:num_tokens]
        batch.block_table.compute_slot_mapping(num_seqs, qsl, positions)
        seq_lens = out.seq_lens[:num_seqs]
        order = longest_first(seq_lens) if 1 < num_seqs <= self.lpt_max_seqs else None
        metadata = {
            gid: AttentionMetadata(
                num_actual_tokens=num_tokens,
                num_reqs=num_seqs,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                query_start_loc=qsl,
                seq_lens=seq_lens,
                block_table=table.block_table.gpu[:num_seqs],
                slot_mapping=table.slot_mapping.gpu[:num_tokens],
                seq_order=order,
            )
            for gid, table in enumerate(batch.block_table.block_tables)
        }
        with set_forward_context(ForwardContext(attn_metadata=metadata, layer_to_group=self.layer_to_group)):
            if self.stage_inputs is not None:  # a later pipeline stage starts from the received activations
                return self._model()(out.input_ids[:num_tokens], positions, self.stage_inputs.narrow(num_tokens))
            return self._model()(out.input_ids[:num_tokens], positions)

    def run(self, staged: StagedStep) -> tuple[torch.Tensor | StageActivations, bool]:
        """Replay the step's bucket graph, or run it eagerly (padded to the bucket in the tests'
        pad_to_buckets mode); the hidden states and whether a graph ran."""
        bucket, reason = self.plan.select(staged.num_reqs, staged.num_tokens, staged.max_query_len)
        if bucket is not None and self.graphs is not None:
            if bucket in self.graphs:
                self.graph_stats.replayed += 1
                return self.graphs.replay(bucket), True
            reason = f"no graph captured for {bucket}"
        elif bucket is not None and self.pad_to_buckets:
            return self._bucket_forward(bucket), False
        if self.graphs is None:
            reason = self.graphs_unavailable() or reason or "graph capture failed"
        self.graph_stats.count_eager(reason)
        return self._forward(staged.num_reqs, staged.num_tokens, staged.max_query_len, staged.max_seq_len), False
