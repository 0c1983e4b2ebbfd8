"""The tiny model of each benchmark shape is the family it claims to be (same architecture, layer kinds
and routing fields). The fused-MoE benchmark's smoke is in tests/test_benchmark_smokes.py."""

import json
from pathlib import Path

import pytest

from benchmarks.common import SHAPES, make_random_model, tiny_shape


@pytest.mark.parametrize("shape", ["gemma-3-12b", "gemma-2-2b", "qwen3-30b-a3b", "mixtral-small"])
def test_tiny_shapes_keep_their_family(shape, tmp_path):
    path = make_random_model(shape, str(tmp_path), dtype="float32", tiny=True)
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["architectures"] == SHAPES[shape]["architectures"]
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 4
    tiny = tiny_shape(shape)
    if "sliding_window" in SHAPES[shape]:
        assert {"sliding_attention", "full_attention"} <= set(cfg["layer_types"]), cfg["layer_types"]
        assert cfg["sliding_window"] == tiny["sliding_window"]
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key in SHAPES[shape]:
            assert cfg[key] == tiny[key]
