"""The loader, the checkpoint reader, the tokenizer and the built-in tiny-random model.

Loading is checked parameter by parameter against the HF model that wrote the checkpoint (fused
QKV / gate-up included); every failure mode must name what is wrong (tensor, shapes, file, field).
The tiny-random model must load in HF transformers and in ours with identical logits.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from actors.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from actors.models.architectures import SUPPORTED_ARCHITECTURES
from actors.models.args import qwen_layer_windows
from actors.models.checkpoint import CorruptCheckpointError, MissingTensorError, TensorShapeError, UnexpectedTensorError
from actors.models.loader import load_model, read_hf_config, resolve_dtype, resolve_model_dir
from actors.models.registry import MODEL_REGISTRY, UnsupportedArchitectureError
from actors.models.tiny_random import VERSION, ensure_tiny_random
from cluster.client.tokenizer import Tokenizer, TokenizerNotFoundError, load_tokenizer_if_present

TINY = dict(
    vocab_size=123,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def save_hf(path, tie: bool = False, **save_kwargs) -> torch.nn.Module:
    config = transformers.Qwen3Config(**TINY, tie_word_embeddings=tie)
    model = transformers.Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(path), **save_kwargs)
    return model


def assert_same_weights(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    ref = dict(hf.named_parameters())
    ref.setdefault("lm_head.weight", hf.get_output_embeddings().weight)
    for name, param in ours.named_parameters():
        if ".qkv_proj." in name:
            parts = [ref[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            parts = [ref[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")]
        else:
            parts = [ref[name]]
        assert torch.equal(param, torch.cat(parts)), name


def test_sharded_index(tmp_path) -> None:
    hf = save_hf(tmp_path, max_shard_size="20KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") and len(shards) > 2
    model, cfg = load_model(str(tmp_path), dtype="float32")
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert_same_weights(model, hf)
    assert model.lm_head is not model.model.embed_tokens


def test_tied_embeddings(tmp_path) -> None:
    hf = save_hf(tmp_path, tie=True)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model, _ = load_model(str(tmp_path), dtype="float32")
    assert model.lm_head is model.model.embed_tokens
    assert_same_weights(model, hf)
    hidden = torch.randn(3, TINY["hidden_size"])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ hf.model.embed_tokens.weight.detach().T)


def test_dtypes(tmp_path) -> None:
    save_hf(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg))
    model, _ = load_model(str(tmp_path))  # auto -> the config's dtype
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = load_model(str(tmp_path), dtype="float16")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    # Logits stay in the model dtype (no float32 copy); the sampler and logprobs read them as float32.
    assert model.compute_logits(torch.randn(2, TINY["hidden_size"], dtype=torch.float16)).dtype == torch.float16
    assert resolve_dtype("auto", {}) == torch.float32
    with pytest.raises(ValueError, match="dtype='int8': must be 'auto' or one of"):
        resolve_dtype("int8", {})
    with pytest.raises(ValueError, match="config.json: dtype='float64' is not supported"):
        resolve_dtype("auto", {"torch_dtype": "float64"})


def _rewrite_tensor(path, name: str, new: torch.Tensor | None) -> None:
    file = str(path / "model.safetensors")
    tensors = load_file(file)
    if new is None:
        del tensors[name]
    else:
        tensors[name] = new
    save_file(tensors, file, metadata={"format": "pt"})


def test_wrong_shape_names_tensor(tmp_path) -> None:
    save_hf(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_tensor(tmp_path, name, torch.zeros(24, 32))
    with pytest.raises(
        TensorShapeError, match=rf"{name}.*model.safetensors: expected shape \(16, 32\), got \(24, 32\)"
    ):
        load_model(str(tmp_path))


def test_missing_tensor_names_it(tmp_path) -> None:
    save_hf(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_tensor(tmp_path, name, None)
    with pytest.raises(MissingTensorError, match=f"checkpoint has no tensor '{name}'"):
        load_model(str(tmp_path))


def test_unused_tensor_is_rejected(tmp_path) -> None:
    save_hf(tmp_path)
    _rewrite_tensor(tmp_path, "model.layers.0.self_attn.q_proj.bias", torch.zeros(32))
    with pytest.raises(
        UnexpectedTensorError, match="'model.layers.0.self_attn.q_proj.bias' are not used by Qwen3ForCausalLM"
    ):
        load_model(str(tmp_path))


def test_truncated_safetensors_names_file(tmp_path) -> None:
    save_hf(tmp_path, max_shard_size="20KB")
    shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
    data = (tmp_path / shard).read_bytes()
    (tmp_path / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=f"{shard}: truncated or corrupt safetensors file"):
        load_model(str(tmp_path))


def test_missing_shard_named_by_index(tmp_path) -> None:
    save_hf(tmp_path, max_shard_size="20KB")
    shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[0]
    os.remove(tmp_path / shard)
    with pytest.raises(RuntimeError, match=f"names shard '{shard}', which is missing"):
        load_model(str(tmp_path))


def test_directory_and_config_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    save_hf(tmp_path)
    cfg = read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"architecture 'GPT2LMHeadModel' is not supported; supported: \[.*'LlamaForCausalLM'",
    ):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, hidden_act="gelu")))
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        load_model(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="no \\*.safetensors weights found"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    ],
)
@pytest.mark.parametrize("config_cls", [transformers.Qwen2Config, transformers.Qwen3Config])
def test_qwen_window_semantics_match_hf(config_cls, extra) -> None:
    raw = dict(TINY, **extra)
    hf = config_cls(**raw)
    expected = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert qwen_layer_windows(raw) == expected
    assert qwen_layer_windows(hf.to_dict()) == expected  # as save_pretrained writes it


def test_sliding_layer_without_window_is_rejected() -> None:
    raw = dict(TINY, layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    with pytest.raises(ValueError, match=r"layer_types\[1\]='sliding_attention' but no window is active"):
        qwen_layer_windows(raw)


def _prefill_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One prefill through a paged cache with a trivial block table (block i+1 holds positions
    4i..4i+3; block 0 is the null block)."""
    n, bs = len(ids), 4
    blocks = -(-n // bs) + 1
    for a in model.attention_layers():
        a.kv_cache = torch.zeros(2, blocks + 1, bs, a.num_kv_heads, a.head_size)
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None]
    md = AttentionMetadata(
        n,
        1,
        n,
        n,
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        table,
        torch.arange(n) + bs,
    )
    ctx = ForwardContext(
        {0: md, 1: md}, {a.layer_name: int(a.sliding_window is not None) for a in model.attention_layers()}
    )
    with torch.no_grad(), set_forward_context(ctx):
        return model.compute_logits(model(ids, torch.arange(n)))


def test_tiny_random_in_hf_and_ours(tmp_path, monkeypatch) -> None:
    path = ensure_tiny_random(str(tmp_path))
    assert path == os.path.join(str(tmp_path), "tiny-random", f"v{VERSION}")
    assert sorted(os.listdir(os.path.dirname(path))) == [f"v{VERSION}"], "no temporary folder left behind"
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert hf.config.layer_types.count("sliding_attention") == 2
    monkeypatch.setenv("KVRAY_CACHE", str(tmp_path))
    assert resolve_model_dir("tiny-random") == path
    model, cfg = load_model("tiny-random")
    assert cfg["tie_word_embeddings"] and model.lm_head is model.model.embed_tokens
    windows = [a.sliding_window for a in model.attention_layers()]
    assert windows == [None, cfg["sliding_window"], None, cfg["sliding_window"]]
    ids = torch.tensor(list(b"kvray tiny-random: a prompt longer than the sliding window of 32 tokens."))
    assert len(ids) > cfg["sliding_window"]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = _prefill_logits(model, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "greedy near-ties: weights too small"


def test_tiny_random_deterministic_and_race_free(tmp_path) -> None:
    roots = [str(tmp_path / f"r{i}") for i in range(2)]
    paths = [ensure_tiny_random(roots[0])]
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_random(roots[1]))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    paths.append(results[0])
    blobs = [open(os.path.join(p, "model.safetensors"), "rb").read() for p in paths]
    assert blobs[0] == blobs[1]
    assert sorted(os.listdir(os.path.dirname(paths[1]))) == [f"v{VERSION}"]


def test_tokenizer(tmp_path) -> None:
    path = ensure_tiny_random(str(tmp_path))
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_id == 256 and tok.eos_token_ids == [256]
    assert tok.vocab_size == read_hf_config(path)["vocab_size"] == 260
    for text in ["hello world", "héllo 世界 🎉\n\ttabs  and  spaces", "", " leading space"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.encode("a<|endoftext|>b") == [97, 256, 98]
    assert tok.decode([97, 256, 98]) == "ab"
    assert tok.decode([97, 256, 98], skip_special_tokens=False) == "a<|endoftext|>b"
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    assert hf_tok("héllo").input_ids == tok.encode("héllo")
    os.remove(os.path.join(path, "tokenizer.json"))
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(path)
    assert load_tokenizer_if_present(path) is None


def test_the_client_list_of_architectures_is_the_registry():
    # The client checks names without importing the models (actors/models/architectures.py).
    assert list(SUPPORTED_ARCHITECTURES) == sorted(MODEL_REGISTRY)
