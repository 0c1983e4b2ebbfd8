"""Model directories as untrusted data: a malformed config.json / generation_config.json / safetensors
index or checkpoint gets an error naming the file and the field, before or while the model loads.

No Ray: these run the loader the worker runs (actors.models.loader.load_model) on the CPU, and the client
checks LLM() runs before any actor starts."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.config.hf_json import ModelConfigError
from actors.models.checkpoint import Checkpoint, CheckpointDtypeError, CorruptCheckpointError
from actors.models.loader import load_model, read_hf_config, resolve_model_dir
from cluster import LLM
from cluster.client.tokenizer import Tokenizer


@pytest.fixture
def model_dir(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(resolve_model_dir("tiny-random"), dst)
    return dst


def _edit_config(model_dir, file="config.json", **fields):
    path = model_dir / file
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))
    return path


def test_the_pristine_copy_loads(model_dir):
    model, cfg = load_model(str(model_dir), dtype="float32")
    assert cfg["vocab_size"] == 260 and sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize(
    "text,rule",
    [
        ('{"vocab_size": 260,', "invalid JSON (Expecting property name enclosed in double quotes at line 1"),
        ("[1, 2]", "expected a JSON object, got list"),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON (RecursionError"),
        ('{"vocab_size": ' + "9" * 5000 + "}", "invalid JSON (ValueError: Exceeds the limit"),
    ],
)
def test_malformed_config_json_names_the_file(model_dir, text, rule):
    (model_dir / "config.json").write_text(text)
    with pytest.raises(ModelConfigError) as e:
        read_hf_config(str(model_dir))
    assert f"{model_dir / 'config.json'}: {rule}" in str(e.value)
    assert len(str(e.value)) < 400


def test_config_json_not_utf8(model_dir):
    (model_dir / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(ModelConfigError, match=r"config.json: not UTF-8 \(byte 16\)"):
        read_hf_config(str(model_dir))


@pytest.mark.parametrize(
    "field,value,rule",
    [
        (
            "eos_token_id",
            "abc",
            "eos_token_id='abc' must be null, a token id or a list of token ids in [0, 2147483647]",
        ),
        ("eos_token_id", [1, -2], "eos_token_id=[1, -2] must be null, a token id or a list"),
        ("eos_token_id", 2**40, "eos_token_id=1099511627776 must be null, a token id"),
        ("rms_norm_eps", None, "rms_norm_eps=None must be a positive finite number"),
        ("rms_norm_eps", "1e-6", "rms_norm_eps='1e-6' must be a positive finite number"),
        ("rope_theta", -1, "rope_theta=-1 must be a positive finite number"),
        ("hidden_size", 2**40, "hidden_size=1099511627776 must be a positive integer <= 2147483647"),
        ("vocab_size", "260", "vocab_size='260' must be a positive integer"),
        ("num_hidden_layers", 2.0, "num_hidden_layers=2.0 must be a positive integer"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings='yes' must be true or false"),
        ("architectures", "Qwen3ForCausalLM", "architectures='Qwen3ForCausalLM' must be a list of strings"),
        ("rope_scaling", [1], "rope_scaling=[1] must be an object or null"),
        ("layer_types", "full_attention", "layer_types='full_attention' must be a list of strings"),
        ("torch_dtype", 32, "torch_dtype=32 must be a string"),
    ],
)
def test_bad_config_json_fields_name_the_file_and_the_field(model_dir, field, value, rule):
    path = _edit_config(model_dir, **{field: value})
    with pytest.raises(ModelConfigError) as e:
        read_hf_config(str(model_dir))
    assert f"{path}: {rule}" in str(e.value)
    with pytest.raises(ModelConfigError):  # and the client refuses it before any actor starts
        LLM(model=str(model_dir))


def test_bad_eos_in_generation_config_names_that_file(model_dir):
    path = _edit_config(model_dir, "generation_config.json", eos_token_id="abc")
    with pytest.raises(ModelConfigError) as e:
        Tokenizer.from_dir(str(model_dir))
    assert f"{path}: eos_token_id='abc' must be null" in str(e.value)


def test_eos_from_both_files(model_dir):
    _edit_config(model_dir, eos_token_id=5)
    _edit_config(model_dir, "generation_config.json", eos_token_id=[5, 7])
    assert Tokenizer.from_dir(str(model_dir)).eos_token_ids == [5, 7]


def _write_index(model_dir, weight_map):
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model_dir / "model.safetensors.index.json"


def _names(model_dir):
    return list(load_file(str(model_dir / "model.safetensors")).keys())


def test_an_index_inside_the_directory_loads(model_dir):
    os.rename(model_dir / "model.safetensors", model_dir / "shard-1.safetensors")
    _write_index(model_dir, {n: "shard-1.safetensors" for n in load_file(str(model_dir / "shard-1.safetensors"))})
    load_model(str(model_dir), dtype="float32")


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_an_index_pointing_outside_the_directory_is_refused(model_dir, tmp_path, where):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(model_dir / "model.safetensors", outside / "model.safetensors")
    target = str(outside / "model.safetensors") if where == "absolute" else "../elsewhere/model.safetensors"
    index = _write_index(model_dir, {n: target for n in _names(model_dir)})
    with pytest.raises(CorruptCheckpointError) as e:
        Checkpoint(str(model_dir))
    assert f"{index}: weight_map[" in str(e.value)
    assert f"points outside the model directory {model_dir}; shards must lie inside it" in str(e.value)


@pytest.mark.parametrize(
    "weight_map,rule",
    [
        (["model.safetensors"], "weight_map=['model.safetensors'] must be an object mapping tensor names"),
        (None, "weight_map=None must be an object"),
        ({"a": 3}, "weight_map['a']=3 must be the name of a .safetensors file"),
        ({"a": "pytorch_model.bin"}, "weight_map['a']='pytorch_model.bin' must be the name of a .safetensors file"),
    ],
)
def test_a_malformed_index_names_the_file_and_the_field(model_dir, weight_map, rule):
    index = _write_index(model_dir, weight_map)
    with pytest.raises(CorruptCheckpointError) as e:
        Checkpoint(str(model_dir))
    assert f"{index}: {rule}" in str(e.value)


def test_an_index_that_is_not_json(model_dir):
    (model_dir / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(CorruptCheckpointError, match="not a valid safetensors index: .*index.json: invalid JSON"):
        Checkpoint(str(model_dir))


def test_int8_weights_under_a_float32_config_are_refused(model_dir):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int8)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointDtypeError) as e:
        load_model(str(model_dir), dtype="float32")
    assert (
        f"tensor 'model.embed_tokens.weight' in {path}: dtype I8 does not match the model's floating-point dtype"
    ) in str(e.value)


def test_bfloat16_weights_load_under_a_float32_config(model_dir):
    path = model_dir / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}, str(path))
    model, _ = load_model(str(model_dir), dtype="float32")
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("start", ["llm", "serve"])
def test_a_missing_model_is_refused_before_ray_starts(tmp_path, monkeypatch, start):
    import ray

    from cluster.config import ConfigError, EngineConfig, apply_overrides
    from cluster.replicas import placement
    from cluster.serve.app import start_server

    def no_ray(**_kw):
        raise AssertionError("Ray was started for a model that is not here")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(placement, "start_local_ray", no_ray)
    missing = str(tmp_path / "nonexistent")
    assert not ray.is_initialized()
    with pytest.raises(ConfigError, match=f"model.model: model='{missing}': no such directory"):
        if start == "llm":
            LLM(model=missing, device="cpu")
        else:
            start_server(apply_overrides(EngineConfig(), {"model": missing}), port=1)
    assert not ray.is_initialized()
