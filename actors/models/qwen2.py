"""Qwen2 / Qwen2.5: the shared decoder with biases on Q, K and V (not O), and Qwen's
use_sliding_window / max_window_layers / layer_types semantics."""

from __future__ import annotations

from typing import Any

import torch

from actors.models.args import parse_args, qwen_layer_windows
from actors.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        args = parse_args(
            hf_config,
            qkv_bias=True,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            layer_windows=qwen_layer_windows(hf_config),
        )
        super().__init__(args, dtype, attention_backend)
