"""One pre-norm decoder-only transformer (Llama layout) shared by every supported family.

Families differ only by options in ModelArgs: QKV/O/MLP biases (Qwen2, Llama's attention_bias /
mlp_bias), per-head q/k RMSNorm before RoPE (Qwen3), and a per-layer sliding window (Mistral, Qwen
layer_types). Parameter names mirror HF's, with q/k/v fused into qkv_proj and gate/up into
gate_up_proj, so checkpoint names map onto them mechanically.
"""

from __future__ import annotations

import os
from typing import Callable, cast

import torch
from safetensors import SafetensorError
from torch import nn

from actors.layers.activation import SiluAndMul
from actors.layers.attention import Attention
from actors.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from actors.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from actors.layers.norm import GemmaRMSNorm, RMSNorm
from actors.layers.rotary import QKNormArgs, RotaryEmbedding
from actors.layers.weight_utils import ShardShapeError, load_weight
from actors.models.args import ModelArgs
from actors.models.checkpoint import Checkpoint, CorruptCheckpointError, TensorShapeError, UnexpectedTensorError
from actors.models.stage import MissingLayer, PipelineStage, StageActivations, current_stage

# (fused parameter, checkpoint sub-module, shard id)
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


# KVRAY_FUSED_KV_WRITE=0 writes K/V with the separate cache-write launch (the A/B switch behind the fusion).
FUSED_KV_WRITE = os.environ.get("KVRAY_FUSED_KV_WRITE", "1") != "0"


def attention_layer_name(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.self_attn.attn"


class DecoderAttention(nn.Module):
    def __init__(
        self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype, backend: str
    ) -> None:
        super().__init__()
        d = args.head_dim
        self.head_dim, self.backend = d, backend
        self.qkv_proj = QKVParallelLinear(args.hidden_size, d, args.num_heads, args.num_kv_heads, args.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(
            args.num_heads * d, args.hidden_size, args.o_bias, dtype, name="num_attention_heads * head_dim"
        )
        self.q_norm: RMSNorm | GemmaRMSNorm | None = _qk_norm(args, dtype, backend) if args.qk_norm else None
        self.k_norm: RMSNorm | GemmaRMSNorm | None = _qk_norm(args, dtype, backend) if args.qk_norm else None
        self.rotary_emb = rotary
        scale = args.query_scale if args.query_scale is not None else d**-0.5
        self.attn = Attention(
            attention_layer_name(layer_idx),
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            d,
            scale,
            sliding_window=args.layer_windows[layer_idx],
            backend=backend,
            softcap=args.attn_softcap,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.backend == "triton":
            cache = self.attn.cache_write() if FUSED_KV_WRITE else None
            if cache is not None:
                q = self.rotary_emb.forward_into_cache(positions, q, k, v, cache, self.qk_norm_args())
                return self.o_proj(self.attn.attend(q))
            return self.o_proj(self.attn(*self.rotary_emb.forward_fused(positions, q, k, self.qk_norm_args()), v))
        if self.q_norm is not None and self.k_norm is not None:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).view(t, -1)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        return self.o_proj(self.attn(q, k, v.contiguous()))

    def qk_norm_args(self) -> QKNormArgs | None:
        """The Triton rotary kernel applies q/k norm (Qwen3, Gemma-3) in the same launch, reading q, k
        and v in place from the QKV output."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return QKNormArgs(
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, gemma=isinstance(self.q_norm, GemmaRMSNorm)
        )


def _qk_norm(args: ModelArgs, dtype: torch.dtype, backend: str) -> RMSNorm | GemmaRMSNorm:
    if args.gemma_norms:
        return GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype, backend)
    return RMSNorm(args.head_dim, args.rms_norm_eps, dtype, backend)


class DecoderMLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [inter, inter], args.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(inter, args.hidden_size, args.mlp_bias, dtype, name="intermediate_size")
        self.act_fn = SiluAndMul(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_fn.backend == "triton":
            fused = self.gate_up_proj.silu_and_mul(x)  # a decode step's few rows: one launch
            if fused is not None:
                return self.down_proj(fused)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype, backend: str, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(args, layer_idx, rotary, dtype, backend)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, backend)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, backend)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """The decoder stack, or the layers of one pipeline stage (actors/models/stage.py): the embedding on
    the first stage, the final norm on the last; other stages' layers are placeholders."""

    # Tensors one stage hands the next (hidden state and residual).
    carries_residual = True

    def __init__(self, args: ModelArgs, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        self.stage = stage = current_stage(args.num_layers)
        self.hidden_size, self.dtype = args.hidden_size, dtype
        self.embed_tokens: VocabParallelEmbedding | None = (
            VocabParallelEmbedding(args.vocab_size, args.hidden_size, dtype) if stage.is_first else None
        )
        rotary = RotaryEmbedding(args.head_dim, args.max_position, args.rope, backend)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, rotary, dtype, backend, self.make_mlp(args, i, dtype, backend))
            if stage.owns_layer(i)
            else MissingLayer()
            for i in range(args.num_layers)
        )
        self.norm: RMSNorm | None = (
            RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, backend) if stage.is_last else None
        )

    def make_mlp(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype, backend: str) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block (mixture-of-experts models override this)."""
        return DecoderMLP(args, dtype, backend)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        stage = self.stage
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            assert intermediate is not None, "a later pipeline stage starts from the previous stage's activations"
            hidden, residual = intermediate.hidden, intermediate.residual
        for layer in self.layers[stage.start : stage.end]:
            hidden, residual = layer(positions, hidden, residual)
        if self.norm is None:
            return StageActivations(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def empty_activations(self, num_tokens: int, device: torch.device) -> StageActivations:
        """Buffers for what the previous stage sends (a later stage receives into them)."""
        shape = (num_tokens, self.hidden_size)
        return StageActivations(
            torch.zeros(shape, dtype=self.dtype, device=device),
            torch.zeros(shape, dtype=self.dtype, device=device) if self.carries_residual else None,
        )


class DecoderForCausalLM(nn.Module):
    """The model API the runner uses (see the team contracts): forward, compute_logits,
    attention_layers, load_weights. Families with another layer layout set `model_class`."""

    model_class: type[nn.Module] = DecoderModel

    def __init__(self, args: ModelArgs, dtype: torch.dtype, attention_backend: str = "torch") -> None:
        super().__init__()
        self.args, self.dtype = args, dtype
        self.model = type(self).model_class(args, dtype, attention_backend)
        stage = self.model.stage
        assert isinstance(stage, PipelineStage)  # every model_class builds one stage (actors/models/stage.py)
        self.stage: PipelineStage = stage
        # The LM head lives on the last stage only; a tied one is the embedding there, or (when the
        # embedding is on another stage) a head of its own filled from the embedding's tensor.
        self.lm_head: VocabParallelEmbedding | None = None
        if self.stage.is_last:
            embed = self.model.embed_tokens
            if args.tie_word_embeddings and embed is not None:
                assert isinstance(embed, VocabParallelEmbedding)  # every model_class embeds with it
                self.lm_head = embed
            else:
                self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        """Hidden states on the last stage (the whole model's), else the activations for the next stage."""
        if intermediate is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError(
                f"pipeline stage [{self.stage.start}, {self.stage.end}) has no LM head: only the last samples"
            )
        return self.lm_head.logits(hidden, self.args.final_softcap)

    def empty_activations(self, num_tokens: int, device: torch.device) -> StageActivations:
        # self.model is typed as an nn.Module attribute; its stage models all define empty_activations.
        make = cast(Callable[[int, torch.device], StageActivations], self.model.empty_activations)
        return make(num_tokens, device)

    def attention_layers(self) -> list[Attention]:
        # Each decoder layer holds one Attention (at layer.self_attn.attn), in layer order.
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def checkpoint_sources(self, param_name: str) -> list[tuple[str, object]]:
        """The checkpoint tensors (name, shard id) that make up one of our parameters."""
        if param_name.startswith("lm_head.") and self.args.tie_word_embeddings:
            return [(param_name.replace("lm_head.", "model.embed_tokens.", 1), None)]  # tied, on another stage
        stacked: list[tuple[str, object]] = [
            (param_name.replace(f".{fused}.", f".{original}."), shard_id)
            for fused, original, shard_id in STACKED_PARAMS
            if f".{fused}." in param_name
        ]
        return stacked or [(param_name, None)]

    def load_weights(self, model_dir: str) -> None:
        """Fill every parameter from the checkpoint; each rank reads only its shard. Tied models
        have no lm_head parameter of their own (named_parameters() lists the shared one once)."""
        ckpt = Checkpoint(model_dir)
        used: set[str] = set()
        try:
            for param_name, param in self.named_parameters():
                for ckpt_name, shard_id in self.checkpoint_sources(param_name):
                    _load_one(ckpt, ckpt_name, param, shard_id)
                    used.add(ckpt_name)
        finally:
            ckpt.close()
        self._check_no_unused(ckpt, used)

    def _check_no_unused(self, ckpt: Checkpoint, used: set[str]) -> None:
        """A tensor we do not consume means the checkpoint is not what config.json claims (say, a
        Qwen2 checkpoint with QKV biases labelled Llama); ignoring it would silently give wrong
        outputs. Rotary caches some exporters save, and the head of a tied model, carry nothing."""
        unused = sorted(
            name
            for name in ckpt.weight_map
            if name not in used
            and self.stage.owns_tensor(name)  # another pipeline stage's tensors are that stage's to read
            and not name.endswith("rotary_emb.inv_freq")
            and not (self.args.tie_word_embeddings and name == "lm_head.weight")
        )
        if unused:
            shown = ", ".join(map(repr, unused[:5])) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise UnexpectedTensorError(
                f"{ckpt.model_dir}: checkpoint tensors {shown} are not used by "
                f"{type(self).__name__} (does config.json describe this checkpoint?)"
            )


def _load_one(ckpt: Checkpoint, name: str, param: torch.Tensor, shard_id: object) -> None:
    loaded = ckpt.get_slice(name)
    path = os.path.join(ckpt.model_dir, ckpt.file_of(name))
    try:
        load_weight(param, loaded, shard_id)
    except ShardShapeError as e:
        raise TensorShapeError(f"tensor {name!r} in {path}: expected shape {e.expected}, got {e.got}") from e
    except SafetensorError as e:
        raise CorruptCheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e
