"""Gemma-2 and Gemma-3 (text), as transformers computes them.

Both interleave sliding-window (local) and global layers, which become two KV-cache groups. Against
the shared decoder they differ in: a sandwich of four (1 + w) RMSNorms per layer (pre/post attention,
pre/post feed-forward); the embedding scaled by sqrt(hidden_size), the scale rounded to the model
dtype first; GeGLU with tanh GELU; attention scaled by query_pre_attn_scalar ** -0.5. Gemma-2 adds
soft-capping of the attention scores and of the final logits. Gemma-3 adds (1 + w) q/k norms, a
separate RoPE base for local layers (rope_local_base_freq) with scaling only on the global ones,
and (as HF) ignores attn_logit_softcapping.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from actors.layers.activation import GELU_APPROXIMATIONS, GeluAndMul
from actors.layers.embedding import VocabParallelEmbedding
from actors.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from actors.layers.norm import GemmaRMSNorm
from actors.layers.rotary import RopeParams, RotaryEmbedding, rope_params_from_config
from actors.models.args import ModelArgs, parse_args, typed_layer_windows
from actors.models.decoder import DecoderAttention, DecoderForCausalLM
from actors.models.stage import MissingLayer, StageActivations, current_stage


class GemmaMLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [inter, inter], False, dtype)
        self.down_proj = RowParallelLinear(inter, args.hidden_size, False, dtype, name="intermediate_size")
        self.act_fn = GeluAndMul(args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, args: ModelArgs, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype, backend: str
    ) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = DecoderAttention(args, layer_idx, rotary, dtype, backend)
        self.mlp = GemmaMLP(args, dtype)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype, backend)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype, backend)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, backend)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    """Gemma's stack, or one pipeline stage of it (as DecoderModel): the sandwich norms carry no
    residual between layers, so a stage hands the next only its hidden state."""

    carries_residual = False

    def __init__(self, args: ModelArgs, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        self.stage = stage = current_stage(args.num_layers)
        self.hidden_size, self.dtype = args.hidden_size, dtype
        self.embed_tokens: VocabParallelEmbedding | None = (
            VocabParallelEmbedding(args.vocab_size, args.hidden_size, dtype) if stage.is_first else None
        )
        # HF multiplies by the scale cast to the weight dtype (sqrt(3072) = 55.43 becomes 55.5 in bf16).
        self.register_buffer("normalizer", torch.tensor(args.hidden_size**0.5).to(dtype), persistent=False)
        rotary = RotaryEmbedding(args.head_dim, args.max_position, args.rope, backend)
        local = (
            rotary
            if args.local_rope is None
            else RotaryEmbedding(args.head_dim, args.max_position, args.local_rope, backend)
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(args, i, local if args.layer_windows[i] is not None else rotary, dtype, backend)
            if stage.owns_layer(i)
            else MissingLayer()
            for i in range(args.num_layers)
        )
        self.norm: GemmaRMSNorm | None = (
            GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype, backend) if stage.is_last else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: StageActivations | None = None
    ) -> torch.Tensor | StageActivations:
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(input_ids) * self.normalizer
        else:
            assert intermediate is not None, "a later pipeline stage starts from the previous stage's activations"
            hidden = intermediate.hidden
        for layer in self.layers[self.stage.start : self.stage.end]:
            hidden = layer(positions, hidden)
        if self.norm is None:
            return StageActivations(hidden)
        return self.norm(hidden)

    def empty_activations(self, num_tokens: int, device: torch.device) -> StageActivations:
        return StageActivations(torch.zeros((num_tokens, self.hidden_size), dtype=self.dtype, device=device))


def _optional_positive(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config.json: {key}={value!r} must be a positive number or null")
    return float(value)


def _gemma_args(cfg: dict[str, Any], default_pattern: int) -> ModelArgs:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported (kvray is causal only)")
    cfg = dict(cfg)
    cfg.setdefault("hidden_activation", cfg.get("hidden_act") or "gelu_pytorch_tanh")
    args = parse_args(
        cfg,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
        qk_norm=False,
        layer_windows=typed_layer_windows(cfg, default_pattern),
        act_key="hidden_activation",
        acts=tuple(GELU_APPROXIMATIONS),
    )
    scalar = _optional_positive(cfg, "query_pre_attn_scalar") or 256.0
    return dataclasses.replace(
        args,
        query_scale=scalar**-0.5,
        gemma_norms=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        final_softcap=_optional_positive(cfg, "final_logit_softcapping"),
    )


def gemma3_ropes(cfg: dict[str, Any]) -> tuple[RopeParams, RopeParams]:
    """(global, local) RoPE. transformers 5 writes `rope_parameters` keyed by layer type; published
    checkpoints carry rope_theta (+ rope_scaling) for global layers and rope_local_base_freq for
    local ones, which HF maps the same way (scaling applies to global layers only)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        missing = [k for k in ("full_attention", "sliding_attention") if not isinstance(params.get(k), dict)]
        if missing:
            raise ValueError(f"config.json: rope_parameters lacks {missing} (needs one entry per layer type)")
        glob, local = (
            rope_params_from_config(
                {"rope_parameters": params[k], "max_position_embeddings": cfg.get("max_position_embeddings")}
            )
            for k in ("full_attention", "sliding_attention")
        )
        return glob, local
    full = dict(params or cfg.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    glob = rope_params_from_config(
        {"rope_parameters": full, "max_position_embeddings": cfg.get("max_position_embeddings")}
    )
    return glob, RopeParams(theta=float(cfg.get("rope_local_base_freq", 10_000.0)))


class Gemma2ForCausalLM(DecoderForCausalLM):
    model_class = GemmaModel

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        args = dataclasses.replace(
            _gemma_args(hf_config, default_pattern=2),
            attn_softcap=_optional_positive(hf_config, "attn_logit_softcapping"),
        )
        super().__init__(args, dtype, attention_backend)


class Gemma3ForCausalLM(DecoderForCausalLM):
    model_class = GemmaModel

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        glob, local = gemma3_ropes(hf_config)
        no_rope = {k: v for k, v in hf_config.items() if k not in ("rope_parameters", "rope_scaling")}
        args = dataclasses.replace(_gemma_args(no_rope, default_pattern=6), qk_norm=True, rope=glob, local_rope=local)
        super().__init__(args, dtype, attention_backend)
