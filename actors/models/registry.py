"""config.json `architectures` -> model class. Tensor parallelism comes from actors.parallel_state,
so build_model must run after the process joined its TP group."""

from __future__ import annotations

from typing import Any, Callable

import torch

from actors.models.architectures import UnsupportedArchitectureError, supported_architecture
from actors.models.decoder import DecoderForCausalLM
from actors.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from actors.models.llama import LlamaForCausalLM, MistralForCausalLM
from actors.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from actors.models.qwen2 import Qwen2ForCausalLM
from actors.models.qwen3 import Qwen3ForCausalLM

# Each family's constructor takes (config.json dict, dtype, attention backend).
ModelClass = Callable[[dict[str, Any], torch.dtype, str], DecoderForCausalLM]

MODEL_REGISTRY: dict[str, ModelClass] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


__all__ = ["MODEL_REGISTRY", "UnsupportedArchitectureError", "build_model", "resolve_architecture"]


def resolve_architecture(hf_config: dict[str, Any]) -> ModelClass:
    return MODEL_REGISTRY[supported_architecture(hf_config)]


def build_model(hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> DecoderForCausalLM:
    """An uninitialised model on the ambient default device (wrap in `with torch.device(...)`)."""
    return resolve_architecture(hf_config)(hf_config, dtype, attention_backend)
