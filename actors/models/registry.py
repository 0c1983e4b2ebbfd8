"""config.json `architectures` -> model class. Tensor parallelism comes from actors.parallel_state,
so build_model must run after the process joined its TP group."""

from __future__ import annotations

from typing import Any, Callable

import torch

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


class UnsupportedArchitectureError(ValueError):
    pass


def resolve_architecture(hf_config: dict[str, Any]) -> ModelClass:
    archs = hf_config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UnsupportedArchitectureError(
            f"config.json: 'architectures' is missing or empty; supported: {sorted(MODEL_REGISTRY)}"
        )
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedArchitectureError(
        f"config.json: architecture {', '.join(map(repr, archs))} is not supported; supported: {sorted(MODEL_REGISTRY)}"
    )


def build_model(hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str = "torch") -> DecoderForCausalLM:
    """An uninitialised model on the ambient default device (wrap in `with torch.device(...)`)."""
    return resolve_architecture(hf_config)(hf_config, dtype, attention_backend)
