"""Qwen3: the shared decoder with per-head RMSNorm on q and k before RoPE, `attention_bias` on
Q/K/V/O, and hybrid `layer_types` (full_attention / sliding_attention) as transformers defines them."""

from __future__ import annotations

from typing import Any

import torch

from actors.models.args import parse_args, qwen_layer_windows
from actors.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        bias = bool(hf_config.get("attention_bias", False))
        args = parse_args(
            hf_config,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=False,
            qk_norm=True,
            layer_windows=qwen_layer_windows(hf_config),
        )
        super().__init__(args, dtype, attention_backend)
