"""Llama 2/3/3.1 (rope_scaling "llama3"/"linear", attention_bias, mlp_bias) and Mistral
(one sliding_window for every layer): the shared decoder with Llama's options."""

from __future__ import annotations

from typing import Any

import torch

from actors.models.args import mistral_layer_windows, parse_args
from actors.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        # HF's Llama has no sliding window: a stray `sliding_window` key is ignored, as HF does.
        bias = bool(hf_config.get("attention_bias", False))
        args = parse_args(
            hf_config,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            qk_norm=False,
            layer_windows=[None] * int(hf_config.get("num_hidden_layers") or 0),
        )
        super().__init__(args, dtype, attention_backend)


class MistralForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> None:
        args = parse_args(
            hf_config,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            layer_windows=mistral_layer_windows(hf_config),
        )
        super().__init__(args, dtype, attention_backend)
