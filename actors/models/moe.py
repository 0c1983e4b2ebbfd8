"""Mixture-of-experts families on the shared decoder: Qwen3-MoE and Mixtral, as transformers computes
them. Attention is Qwen3's (q/k norms) or Mistral's (one optional window); the feed-forward block of a
sparse layer is a top-k router over experts (actors/layers/fused_moe.py: the fused Triton kernel on
the GPU, HF's expert loop on the CPU), each expert sharded along its intermediate dimension.

Checkpoints keep one tensor per expert (`experts.{e}.gate_proj` / `up_proj` / `down_proj`, Mixtral's
`w1` / `w3` / `w2` under `block_sparse_moe`); they are stacked into each layer's w13 / w2 at load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from actors.layers.fused_moe import SparseMoeBlock
from actors.models.args import ModelArgs, MoeArgs, mistral_layer_windows, parse_args, positive_int
from actors.models.decoder import DecoderForCausalLM, DecoderMLP, DecoderModel


class MoeDecoderModel(DecoderModel):
    def make_mlp(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype, backend: str) -> nn.Module:
        moe = args.moe
        assert moe is not None
        if not moe.sparse_layers[layer_idx]:
            return DecoderMLP(args, dtype, backend)
        return SparseMoeBlock(
            moe.num_experts,
            moe.top_k,
            args.hidden_size,
            moe.intermediate_size,
            moe.normalize_topk,
            moe.float32_weights,
            dtype,
            backend,
        )


class MoeForCausalLM(DecoderForCausalLM):
    model_class = MoeDecoderModel
    # HF sub-module of a sparse layer's block, and its experts' (gate, up, down) tensor names.
    moe_module = "mlp"
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def checkpoint_sources(self, param_name: str) -> list[tuple[str, object]]:
        prefix, _, leaf = param_name.rpartition(".experts.")
        if not prefix:
            return super().checkpoint_sources(param_name.replace(".mlp.gate.", f".{self.moe_module}.gate."))
        base = prefix.replace(".mlp", f".{self.moe_module}") + ".experts"
        gate, up, down = self.expert_names
        moe = self.args.moe
        assert moe is not None  # a MoE family's args always carry it (_moe_args)
        n = moe.num_experts
        if leaf == "w13_weight":
            return [
                src
                for e in range(n)
                for src in ((f"{base}.{e}.{gate}.weight", (e, "gate")), (f"{base}.{e}.{up}.weight", (e, "up")))
            ]
        return [(f"{base}.{e}.{down}.weight", (e, "down")) for e in range(n)]


def _sparse_layers(cfg: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen3-MoE: experts unless the layer is in mlp_only_layers or off the decoder_sparse_step grid."""
    step = positive_int(cfg, "decoder_sparse_step", cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _num_experts(cfg: dict[str, Any]) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map).
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    return positive_int(cfg, key)


def _moe_args(
    cfg: dict[str, Any],
    args: ModelArgs,
    inter_key: str,
    normalize: bool,
    float32_weights: bool,
    sparse: tuple[bool, ...],
) -> ModelArgs:
    num_experts = _num_experts(cfg)
    top_k = positive_int(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    moe = MoeArgs(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=positive_int(cfg, inter_key),
        normalize_topk=normalize,
        float32_weights=float32_weights,
        sparse_layers=sparse,
    )
    return dataclasses.replace(args, moe=moe)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        bias = bool(hf_config.get("attention_bias", False))
        # HF's Qwen3-MoE applies `sliding_window` (when set) to every layer, as Mistral does.
        args = parse_args(
            hf_config,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=False,
            qk_norm=True,
            layer_windows=mistral_layer_windows(hf_config),
        )
        args = _moe_args(
            hf_config,
            args,
            "moe_intermediate_size",
            bool(hf_config.get("norm_topk_prob", False)),
            False,
            _sparse_layers(hf_config, args.num_layers),
        )
        super().__init__(args, dtype, attention_backend)


class MixtralForCausalLM(MoeForCausalLM):
    moe_module = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        args = parse_args(
            hf_config,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            layer_windows=mistral_layer_windows(hf_config),
        )
        args = _moe_args(hf_config, args, "intermediate_size", True, True, (True,) * args.num_layers)
        super().__init__(args, dtype, attention_backend)
