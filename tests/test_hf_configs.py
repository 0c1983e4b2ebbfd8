"""Real checkpoints' config.json files are accepted; hostile values are still refused.

tests/data/hf_configs/ holds the config.json of each family's published checkpoints (Llama-3.1-8B-Instruct,
Qwen2.5-7B-Instruct, Qwen3-0.6B, Qwen3-30B-A3B, Mistral-7B v0.1 and v0.3, Mixtral-8x7B, Gemma-2-9B,
Gemma-3-1B-it and Gemma-3-4B-it's text config), written out as the hub serves them. Each must pass the
same path a user's model takes: config.json read and checked on the client (actors.config.hf_json), the
engine config checked against it (model_rules), and the model built (on the meta device: no weights).
The same goes for each config re-saved by transformers' own config class (transformers 5 writes
rope_parameters and layer_types) and for each class's defaults: validation must accept every value the
HF config classes accept for these families, where HF's model computes something well defined.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import transformers

from actors.config.hf_json import ModelConfigError, read_config_json
from actors.models.args import qwen_layer_windows
from actors.models.registry import build_model
from cluster.config import EngineConfig, apply_overrides, validate_for_model

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_configs")

# name -> (transformers config class, the layer windows HF's model applies)
CHECKPOINTS: dict[str, tuple[type, Any]] = {
    "llama-3.1-8b-instruct": (transformers.LlamaConfig, [None] * 32),
    "qwen2.5-7b-instruct": (transformers.Qwen2Config, [None] * 28),
    "qwen3-0.6b": (transformers.Qwen3Config, [None] * 28),
    "qwen3-30b-a3b": (transformers.Qwen3MoeConfig, [None] * 48),
    "mistral-7b-v0.1": (transformers.MistralConfig, [4096] * 32),
    "mistral-7b-v0.3": (transformers.MistralConfig, [None] * 32),
    "mixtral-8x7b-v0.1": (transformers.MixtralConfig, [None] * 32),
    "gemma-2-9b": (transformers.Gemma2Config, [4096, None] * 21),
    "gemma-3-1b-it": (transformers.Gemma3TextConfig, ([512] * 5 + [None]) * 4 + [512, 512]),
    "gemma-3-4b-it-text": (transformers.Gemma3TextConfig, ([1024] * 5 + [None]) * 5 + [1024] * 4),
}
ARCH = {
    transformers.LlamaConfig: "LlamaForCausalLM",
    transformers.Qwen2Config: "Qwen2ForCausalLM",
    transformers.Qwen3Config: "Qwen3ForCausalLM",
    transformers.Qwen3MoeConfig: "Qwen3MoeForCausalLM",
    transformers.MistralConfig: "MistralForCausalLM",
    transformers.MixtralConfig: "MixtralForCausalLM",
    transformers.Gemma2Config: "Gemma2ForCausalLM",
    transformers.Gemma3TextConfig: "Gemma3ForCausalLM",
}


def _real(name: str) -> dict[str, Any]:
    with open(os.path.join(DATA, f"{name}.json")) as f:
        return json.load(f)


def _accepts(tmp_path: Any, cfg: dict[str, Any]) -> list[int | None]:
    """The client's checks and the model build, as `LLM(model=dir)` and the worker run them; -> the
    per-layer windows the built model applies."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    hf = read_config_json(str(model_dir))
    validate_for_model(apply_overrides(EngineConfig(), {"model": str(model_dir)}), hf)
    with torch.device("meta"):
        model = build_model(hf, torch.bfloat16)
    return [a.sliding_window for a in model.attention_layers()]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_a_published_config_json_is_accepted(tmp_path, name):
    assert _accepts(tmp_path, _real(name)) == CHECKPOINTS[name][1]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_the_same_config_resaved_by_transformers_is_accepted(tmp_path, name):
    cls, windows = CHECKPOINTS[name]
    cfg = cls(**_real(name)).to_dict()  # what save_pretrained writes today
    assert _accepts(tmp_path, cfg) == windows


@pytest.mark.parametrize("cls", sorted(ARCH, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_the_config_class_defaults_are_accepted(tmp_path, cls):
    cfg = dict(cls(num_hidden_layers=4).to_dict(), architectures=[ARCH[cls]])
    assert len(_accepts(tmp_path, cfg)) == 4


@pytest.mark.parametrize("cls", [transformers.Qwen2Config, transformers.Qwen3Config], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "fields",
    [
        {"max_window_layers": 0},  # the reported refusal: legal in HF, every layer may slide
        {"max_window_layers": 0, "use_sliding_window": True, "sliding_window": 4096},
        {"max_window_layers": 2, "use_sliding_window": True, "sliding_window": 4096},
        {"max_window_layers": 100, "use_sliding_window": True, "sliding_window": 4096},
        {"max_window_layers": -1, "use_sliding_window": True, "sliding_window": 4096},
        {"sliding_window": -5},  # ignored by HF (and by kvray) while use_sliding_window is false
        {"sliding_window": 0, "use_sliding_window": False},
    ],
)
def test_qwen_window_fields_hf_accepts_are_accepted_with_hfs_meaning(tmp_path, cls, fields):
    real = _real("qwen2.5-7b-instruct" if cls is transformers.Qwen2Config else "qwen3-0.6b")
    raw = dict(real, num_hidden_layers=4, **fields)
    hf = cls(**raw)
    expected = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert qwen_layer_windows(raw) == expected
    assert _accepts(tmp_path, raw) == expected
    assert _accepts(tmp_path, dict(hf.to_dict(), architectures=raw["architectures"])) == expected


@pytest.mark.parametrize(
    "name,fields,error,rule",
    [
        (
            "qwen3-0.6b",
            {"max_window_layers": 1.5},
            ModelConfigError,
            "max_window_layers=1.5 must be null or an integer",
        ),
        (
            "qwen3-0.6b",
            {"max_window_layers": "28"},
            ModelConfigError,
            "max_window_layers='28' must be null or an integer",
        ),
        ("qwen3-0.6b", {"max_window_layers": True}, ModelConfigError, "max_window_layers=True must be null or an"),
        ("qwen3-0.6b", {"max_window_layers": 2**40}, ModelConfigError, "max_window_layers=1099511627776 must be"),
        ("qwen2.5-7b-instruct", {"sliding_window": 2**40}, ModelConfigError, "sliding_window=1099511627776 must be"),
        ("qwen2.5-7b-instruct", {"sliding_window": "4096"}, ModelConfigError, "sliding_window='4096' must be null"),
        # a window that is applied must be positive: HF would mask every key out (NaN) on these
        ("mistral-7b-v0.1", {"sliding_window": 0}, ValueError, "sliding_window=0 must be a positive integer"),
        (
            "qwen3-0.6b",
            {"use_sliding_window": True, "sliding_window": -1, "max_window_layers": 0},
            ValueError,
            "sliding_window=-1",
        ),
        ("gemma-2-9b", {"sliding_window": 0}, ValueError, "sliding_window=0 must be a positive integer"),
        ("gemma-3-1b-it", {"sliding_window": None}, ValueError, "layer_types[0]='sliding_attention' but sliding_"),
        ("gemma-3-1b-it", {"layer_types": ["chunked"] * 26}, ValueError, "layer_types[0]='chunked' is not supported"),
        ("qwen3-0.6b", {"layer_types": ["full_attention"] * 3}, ValueError, "3 layer types for num_hidden_layers=28"),
        ("qwen3-0.6b", {"num_key_value_heads": 0}, ModelConfigError, "num_key_value_heads=0 must be a positive"),
        ("llama-3.1-8b-instruct", {"head_dim": 0}, ModelConfigError, "head_dim=0 must be a positive integer"),
        ("llama-3.1-8b-instruct", {"num_hidden_layers": -1}, ModelConfigError, "num_hidden_layers=-1 must be a"),
        ("mixtral-8x7b-v0.1", {"num_experts_per_tok": 9}, ValueError, "num_experts_per_tok=9 exceeds the 8 experts"),
    ],
)
def test_hostile_values_are_still_refused_naming_the_field(tmp_path, name, fields, error, rule):
    with pytest.raises(error) as e:
        _accepts(tmp_path, dict(_real(name), **fields))
    assert rule in str(e.value)
