"""Load an HF-format model directory into one of our tensor-parallel models.

Reads config.json (never executes remote code), builds the model on the target device with the
target dtype, then fills it from safetensors only, each rank reading just its own slices.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from actors.config.hf_json import read_config_json
from actors.config.section import ConfigError
from actors.models.decoder import DecoderForCausalLM
from actors.models.model_dir import TINY_RANDOM, resolve_model_dir
from actors.models.registry import build_model
from actors.models.stage import PipelineStage, building_stage

__all__ = ["TINY_RANDOM", "load_model", "read_hf_config", "resolve_dtype", "resolve_model_dir"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger(__name__)
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """config.json, every field kvray reads checked (see actors.config.hf_json)."""
    return read_config_json(model_dir)


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any]) -> torch.dtype:
    """ "auto" takes the checkpoint's dtype from config.json (`dtype`, or the older `torch_dtype`),
    float32 when it names none."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype}: must be one of {sorted(DTYPES)} or 'auto'")
        return dtype
    if dtype == "auto":
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        name = _DTYPE_ALIASES.get(name, name)
        if name not in DTYPES:
            raise ValueError(f"config.json: dtype={name!r} is not supported; pass dtype= one of {sorted(DTYPES)}")
        return DTYPES[name]
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(
    model_dir_or_name: str,
    dtype: str | torch.dtype = "auto",
    attention_backend: str = "torch",
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    stage_for: Callable[[int], PipelineStage] | None = None,
) -> tuple[DecoderForCausalLM, dict[str, Any]]:
    """-> (model in eval mode with weights loaded on `device`, the config.json dict). quantization="fp8"
    swaps the dense linear weights for e4m3 ones once loaded (actors/layers/fp8_linear.py).
    `stage_for(num_hidden_layers)` names the pipeline stage to build (and read tensors for); None: all."""
    model_dir = resolve_model_dir(model_dir_or_name)
    hf_config = read_hf_config(model_dir)
    torch_dtype = resolve_dtype(dtype, hf_config)
    if quantization == "fp8" and torch.device(device).type == "cuda" and torch_dtype != torch.bfloat16:
        raise ConfigError(
            f"model.quantization='fp8': the GPU's row-wise scaled GEMM writes bfloat16 only, and the model "
            f"runs in {str(torch_dtype).removeprefix('torch.')}; set model.dtype=bfloat16"
        )
    stage = None if stage_for is None else stage_for(int(hf_config["num_hidden_layers"]))
    with torch.device(device), building_stage(stage):
        model = build_model(hf_config, torch_dtype, attention_backend)
    model.load_weights(model_dir)
    model.eval()
    if quantization == "fp8":
        quantize_linears_fp8(model)
    return model, hf_config


def quantize_linears_fp8(model: torch.nn.Module) -> int:
    """Every dense linear layer's weight to e4m3 (the embedding, LM head, router and experts stay); the
    bf16 copies are freed. Returns how many layers changed."""
    from actors.layers.linear import ColumnParallelLinear, RowParallelLinear

    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    done = sum(m.quantize_fp8() for m in layers)
    if done < len(layers):
        logger.warning(
            "quantization fp8: %d of %d linear layers kept their dtype (dims not multiples of 16)",
            len(layers) - done,
            len(layers),
        )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return done
