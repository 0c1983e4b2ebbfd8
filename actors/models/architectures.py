"""The architectures kvray serves, by config.json name, without importing a model (or torch).

The client checks a model against this list before any actor starts, and stays free of torch: importing
it cost every `LLM(...)` about 3 s of start-up on the H200 host. actors.models.registry maps the same
names to the classes.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = (
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


class UnsupportedArchitectureError(ValueError):
    pass


def supported_architecture(hf_config: dict[str, Any]) -> str:
    """The first of config.json's `architectures` that kvray serves; else an error naming the field,
    what it holds and what is supported."""
    archs = hf_config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UnsupportedArchitectureError(
            f"config.json: 'architectures' is missing or empty; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise UnsupportedArchitectureError(
        f"config.json: architecture {', '.join(map(repr, archs))} is not supported; "
        f"supported: {list(SUPPORTED_ARCHITECTURES)}"
    )
