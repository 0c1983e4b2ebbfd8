"""The decoder-only model shape read from an HF config.json dict, validated with errors that name
the config field. One dataclass serves every supported family; the family modules only decide the
options (biases, q/k norm, which layers slide)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.layers.rotary import RopeParams, rope_params_from_config


@dataclass(frozen=True)
class MoeArgs:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    normalize_topk: bool  # renormalise the top-k weights to sum to 1
    float32_weights: bool  # Mixtral keeps routing weights in float32; Qwen3-MoE casts them
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeParams
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention
    hidden_act: str = "silu"
    query_scale: float | None = None  # softmax scale of attention; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma-2: cap * tanh(score / cap) on attention scores
    final_softcap: float | None = None  # Gemma: the same on the final logits
    local_rope: RopeParams | None = None  # Gemma-3: the sliding layers' own RoPE
    gemma_norms: bool = False  # RMSNorms scale by (1 + w) in float32 (Gemma)
    moe: MoeArgs | None = None  # mixture-of-experts feed-forward (Qwen3-MoE, Mixtral)


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config.json: missing required field {key!r}")
    return cfg[key]


def positive_int(cfg: dict[str, Any], key: str, value: Any = None) -> int:
    value = _require(cfg, key) if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key}={value!r} must be a positive integer")
    return value


def parse_args(
    cfg: dict[str, Any],
    *,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    qk_norm: bool,
    layer_windows: list[int | None],
    act_key: str = "hidden_act",
    acts: tuple[str, ...] = ("silu",),
) -> ModelArgs:
    act = cfg.get(act_key) or acts[0]
    if act not in acts:
        raise ValueError(f"config.json: {act_key}={act!r} is not supported (supported: {list(acts)})")
    num_heads = positive_int(cfg, "num_attention_heads")
    hidden = positive_int(cfg, "hidden_size")
    num_kv = positive_int(cfg, "num_key_value_heads", cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv:
        raise ValueError(
            f"config.json: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
        )
    head_dim = positive_int(cfg, "head_dim", cfg.get("head_dim") or hidden // num_heads)
    num_layers = positive_int(cfg, "num_hidden_layers")
    if len(layer_windows) != num_layers:
        raise ValueError(f"config.json: {len(layer_windows)} layer types for num_hidden_layers={num_layers}")
    return ModelArgs(
        vocab_size=positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=positive_int(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=positive_int(cfg, "max_position_embeddings"),
        rope=rope_params_from_config(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        layer_windows=tuple(layer_windows),
        hidden_act=act,
    )


def _window(cfg: dict[str, Any], key: str = "sliding_window") -> int:
    return positive_int(cfg, key)


LAYER_TYPES = ("full_attention", "sliding_attention")


def windows_from_layer_types(cfg: dict[str, Any], layer_types: Any, window_active: bool = True) -> list[int | None]:
    """Per layer: None for `full_attention`, the config's positive `sliding_window` for `sliding_attention`
    (the one reading of `layer_types` every family shares); `window_active=False` (Qwen without
    use_sliding_window) makes a sliding layer an error rather than a silent full one."""
    if not isinstance(layer_types, list):
        raise ValueError(f"config.json: layer_types={layer_types!r} must be a list")
    windows: list[int | None] = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            if not window_active or cfg.get("sliding_window") is None:
                raise ValueError(
                    f"config.json: layer_types[{i}]='sliding_attention' but no window is active "
                    "(needs use_sliding_window=true and sliding_window set)"
                    if not window_active
                    else f"config.json: layer_types[{i}]='sliding_attention' but sliding_window is null"
                )
            windows.append(_window(cfg))
        else:
            raise ValueError(
                f"config.json: layer_types[{i}]={kind!r} is not supported (supported: {list(LAYER_TYPES)})"
            )
    return windows


def qwen_layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Qwen2/Qwen3 as transformers defines them: the window exists only when use_sliding_window is
    true; `layer_types` lists full_attention / sliding_attention per layer, and when absent the
    layers from max_window_layers on slide (if a window exists). max_window_layers may be any integer,
    as in HF: 0 (or less) makes every layer slide, num_hidden_layers or more makes none."""
    num_layers = positive_int(cfg, "num_hidden_layers")
    active = bool(cfg.get("use_sliding_window", False)) and cfg.get("sliding_window") is not None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        max_window_layers = cfg.get("max_window_layers")
        max_window_layers = 28 if max_window_layers is None else max_window_layers  # HF's default
        layer_types = [
            "sliding_attention" if active and i >= max_window_layers else "full_attention" for i in range(num_layers)
        ]
    return windows_from_layer_types(cfg, layer_types, window_active=active)


def mistral_layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Mistral: one `sliding_window` (or null) for every layer, as MistralAttention applies it."""
    num_layers = positive_int(cfg, "num_hidden_layers")
    window = _window(cfg) if cfg.get("sliding_window") is not None else None
    return [window] * num_layers


def typed_layer_windows(cfg: dict[str, Any], default_pattern: int) -> list[int | None]:
    """Gemma-2/3: `layer_types` when given, else every `sliding_window_pattern`-th layer is global and
    the others slide (Gemma-2: every second, Gemma-3: every sixth), as their HF configs derive it."""
    num_layers = positive_int(cfg, "num_hidden_layers")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = positive_int(cfg, "sliding_window_pattern", cfg.get("sliding_window_pattern") or default_pattern)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return windows_from_layer_types(cfg, layer_types)
