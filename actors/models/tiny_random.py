"""The built-in "tiny-random" model: a small Qwen3-style hybrid (full + sliding-window layers) with
seeded random weights and a byte-level tokenizer, written in HF format on first use so the engine
runs on a fresh machine with no downloads. HF transformers loads the same directory
(Qwen3ForCausalLM.from_pretrained), which is how tests use it as an oracle.

Location: <root>/tiny-random/v<VERSION>, root = `cache_dir`, else $KVRAY_CACHE, else ~/.cache/kvray.
It is written into a temporary sibling and renamed into place, so concurrent workers never see a
half-written model; bump VERSION whenever the content changes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

VERSION = 2
SEED = 1234
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS_ID, PAD_ID = 256, 259
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "generation_config.json",
    "tokenizer_config.json",
)
# Weight scales: large enough that greedy decoding never meets a near-tie in float32 (top-2 logit
# margins stay well above float32 noise) and varied enough that greedy text does not collapse into
# one repeated token.
EMBED_STD, LINEAR_STD, NORM_JITTER = 1.0, 0.3, 0.1
# ChatML, as Qwen models use it (v2 added it; the weights are those of v1).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def tiny_random_config() -> dict[str, Any]:
    num_layers = 4
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 256 + len(SPECIAL_TOKENS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "use_sliding_window": True,
        "sliding_window": 32,
        "layer_types": ["full_attention", "sliding_attention"] * (num_layers // 2),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": "float32",
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "kvray_tiny_random_version": VERSION,
    }


def _tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    return shapes


def random_weights(cfg: dict[str, Any], seed: int = SEED) -> dict[str, torch.Tensor]:
    """Deterministic: one CPU generator, tensors drawn in sorted name order."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(_tensor_shapes(cfg).items()):
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name == "model.norm.weight":
            # Mixed signs: with tied embeddings a near-identity final norm makes every token predict
            # itself, and greedy decoding would repeat one token forever.
            out[name] = noise
        elif name.endswith("norm.weight"):
            out[name] = 1.0 + NORM_JITTER * noise  # norms near 1, but not 1, so loading them is tested
        elif name == "model.embed_tokens.weight":
            out[name] = EMBED_STD * noise
        else:
            out[name] = LINEAR_STD * noise
    return out


def _byte_alphabet() -> dict[int, str]:
    """Byte -> printable character, the ByteLevel convention: printable Latin-1 bytes stand for
    themselves, the others are shifted past U+00FF so every byte has a visible, unique symbol."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, shift = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def byte_tokenizer() -> Tokenizer:
    """Token id = byte value for 0..255 (BPE with no merges), then the special tokens."""
    vocab = {ch: b for b, ch in _byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _write_model(path: str) -> None:
    cfg = tiny_random_config()
    save_file(random_weights(cfg), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    byte_tokenizer().save(os.path.join(path, "tokenizer.json"))
    files = {
        "config.json": cfg,
        "generation_config.json": {"eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": SPECIAL_TOKENS[0],
            "pad_token": SPECIAL_TOKENS[3],
            "model_max_length": cfg["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    }
    for name, content in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f, indent=2)


def ensure_tiny_random(cache_dir: str | None = None) -> str:
    root = cache_dir or os.environ.get("KVRAY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvray")
    parent = os.path.join(root, "tiny-random")
    final = os.path.join(parent, f"v{VERSION}")
    if os.path.isdir(final):
        missing = [f for f in REQUIRED_FILES if not os.path.isfile(os.path.join(final, f))]
        if missing:
            raise RuntimeError(f"{final}: incomplete tiny-random model (missing {missing}); delete the folder")
        return final
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    try:
        _write_model(tmp)
        # mkdtemp makes a private folder; the cache is meant to be shared (e.g. by Ray workers of
        # another user on the node), so open it up before publishing it.
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):  # a real failure, not another process winning the race
            raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
