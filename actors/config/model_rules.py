"""The config rules that need the model's config.json: heads split evenly over the TP ranks, and the
one context limit (model.max_model_len resolved against max_position_embeddings).
"""

from __future__ import annotations

from typing import Any, Mapping

from actors.config.engine import EngineConfig
from actors.config.section import ConfigError


def validate_for_model(config: EngineConfig, hf_config: Mapping[str, Any]) -> None:
    """Rules that need the model: heads split evenly over TP ranks, context within the model's limit."""
    tp = config.parallel.tensor_parallel_size
    heads = int(hf_config.get("num_attention_heads", 0))
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    name = config.model.model
    if heads and heads % tp:
        raise ConfigError(
            f"config: parallel.tensor_parallel_size={tp}: must divide the model's num_attention_heads={heads} ({name})"
        )
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise ConfigError(
            f"config: parallel.tensor_parallel_size={tp}: must divide the model's "
            f"num_key_value_heads={kv_heads}, or be a multiple of it ({name})"
        )
    resolved_max_model_len(config, hf_config)
    num_layers = hf_config.get("num_hidden_layers")
    if isinstance(num_layers, int) and not isinstance(num_layers, bool):
        pipeline_layer_partition(config, num_layers)


def pipeline_layer_partition(config: EngineConfig, num_layers: int) -> list[int]:
    """Decoder layers per pipeline stage: parallel.pp_layer_partition when set (it must sum to the
    model's layers), else an even split whose remainder goes to the last stages (the first stage also
    embeds, the last one also samples; vLLM splits the same way)."""
    p = config.parallel
    pp = p.pipeline_parallel_size
    name = config.model.model
    if p.pp_layer_partition is not None:
        part = list(p.pp_layer_partition)
        if sum(part) != num_layers:
            raise ConfigError(
                f"config: parallel.pp_layer_partition={part}: must sum to the model's num_hidden_layers="
                f"{num_layers} ({name}); it sums to {sum(part)}"
            )
        return part
    if pp > num_layers:
        raise ConfigError(
            f"config: parallel.pipeline_parallel_size={pp}: must be <= the model's num_hidden_layers="
            f"{num_layers} ({name}): every stage needs at least one layer"
        )
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s >= pp - extra else 0) for s in range(pp)]


def stage_layer_range(config: EngineConfig, num_layers: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers pipeline stage `pp_rank` owns."""
    part = pipeline_layer_partition(config, num_layers)
    start = sum(part[:pp_rank])
    return start, start + part[pp_rank]


def resolved_max_model_len(config: EngineConfig, hf_config: Mapping[str, Any]) -> int:
    """The one rule for the context limit (the workers size their buffers with it, the driver and the
    client read it back): model.max_model_len when set, never above the model's max_position_embeddings;
    else that; a model whose config.json has none must set it."""
    limit = hf_config.get("max_position_embeddings")
    mml = config.model.max_model_len
    name = config.model.model
    if mml is None:
        if limit is None:
            raise ConfigError(
                f"config: model.max_model_len=null: the model's config.json has no "
                f"max_position_embeddings; set model.max_model_len ({name})"
            )
        return int(limit)
    if limit is not None and mml > int(limit):
        raise ConfigError(
            f"config: model.max_model_len={mml}: must be <= the model's max_position_embeddings={limit} ({name})"
        )
    return int(mml)
