"""Default sampling settings, one per field for every entry point, as vLLM chooses them: the model's
generation_config.json where it sets temperature, top_p, top_k, repetition_penalty, min_p or
max_new_tokens, else
vLLM's SamplingParams defaults (temperature 1.0: sampling, not greedy; max_tokens 16). They apply to
`LLM.generate`/`chat` without sampling_params, to `kvray run` lines for every field they leave out, and to
`kvray serve`. A SamplingParams the caller builds keeps its own values.

One exception, vLLM's too: a chat request of the OpenAI API (`kvray serve` /v1/chat/completions, and
OpenAI Batch chat lines in `kvray run`) without max_tokens may run to the end of the context,
max_model_len minus its prompt (`chat_max_tokens`); /v1/completions keeps 16.
"""

from __future__ import annotations

import os
from typing import Any

from actors.config.hf_json import ModelConfigError, read_json_object
from kvcore.request import RequestValidationError, SamplingParams

GENERATION_CONFIG = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
VLLM_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "max_tokens": 16,
}


def generation_config_overrides(model_dir: str | None) -> dict[str, Any]:
    """The SamplingParams fields the model's generation_config.json sets (unset or null keys skipped)."""
    if model_dir is None:
        return {}
    path = os.path.join(model_dir, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return {}
    cfg = read_json_object(path)
    return {field: cfg[key] for key, field in GENERATION_CONFIG_KEYS.items() if cfg.get(key) is not None}


def default_sampling_params(model_dir: str | None) -> SamplingParams:
    overrides = generation_config_overrides(model_dir)
    try:
        return SamplingParams(**{**VLLM_DEFAULTS, **overrides})
    except RequestValidationError as e:  # a checkpoint's value out of range (say top_k=-5): name the file
        raise ModelConfigError(f"{os.path.join(str(model_dir), GENERATION_CONFIG)}: {e}") from None


def chat_max_tokens(max_model_len: int, prompt_len: int) -> int:
    """max_tokens of an OpenAI chat request that sets none (vLLM's server): the rest of the context."""
    return max(1, max_model_len - prompt_len)
