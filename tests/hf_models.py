"""Tiny random HF checkpoints of every supported family, and HF's own greedy continuations of them.

The models are built with transformers' config classes and saved with save_pretrained (float32), so
they are exactly what a user's HF directory looks like. Weights use a large init std: with the default
0.02 the logits are nearly flat and greedy decoding hits numerical ties that say nothing about bugs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

VOCAB = 256
MAX_POS = 256
INIT_STD = 0.5
TIE_MARGIN = 1e-4  # an HF top-1/top-2 logit gap below this is a numerical tie, not a reference

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    max_position_embeddings=MAX_POS,
    initializer_range=INIT_STD,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _llama():
    from transformers import LlamaConfig

    # Llama-3.1 style rope scaling, so the llama3 frequency remapping is exercised too.
    rope = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    return LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_parameters=rope)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON, num_hidden_layers=3, num_key_value_heads=2, tie_word_embeddings=True)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16)


def _mistral():
    from transformers import MistralConfig

    # One KV head: at TP=2 it is replicated on both ranks. Window 40 < most prompts.
    return MistralConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=1, sliding_window=40)


def _qwen3_hybrid():
    from transformers import Qwen3Config

    return Qwen3Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=24,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )


def _gemma2():
    from transformers import Gemma2Config

    # Default pattern (even layers slide), window 24 < most prompts; small caps so both bite.
    return Gemma2Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0,
    )


def _gemma3():
    from transformers import Gemma3TextConfig

    # Local layers use their own base; only the global one is scaled (linear), as HF maps them.
    rope = {
        "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=5000.0),
        "sliding_attention": dict(rope_type="default", rope_theta=100.0),
    }
    return Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=24,
        rope_parameters=rope,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    # Layer 1 is dense (mlp_only_layers); top-2 of 8 experts, weights not renormalised (HF's default).
    return Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    )


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(
        **{**COMMON, "intermediate_size": 32},
        num_hidden_layers=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def _qwen3_hybrid_2l():
    """qwen3_hybrid on two layers (one full, one sliding): for the runs that interpret Triton per layer."""
    from transformers import Qwen3Config

    return Qwen3Config(
        **COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=24,
        layer_types=["full_attention", "sliding_attention"],
    )


FAMILIES = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "qwen3_hybrid": _qwen3_hybrid,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}


# Smaller variants of a family, for single tests; not in FAMILIES (every family gets the full test matrix).
VARIANTS = {"qwen3_hybrid_2l": _qwen3_hybrid_2l}


def build_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = {**FAMILIES, **VARIANTS}[family]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # Norm weights stay at 1 from init; perturb them so a missing or misplaced norm shows up too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model.eval()


def save_hf_model(family: str, path: str, seed: int = 0) -> torch.nn.Module:
    model = build_hf_model(family, seed)
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts of 5 to 120 tokens; four share one 48-token prefix."""
    rng = np.random.default_rng(seed)

    def tok(n: int) -> list[int]:
        return rng.integers(3, VOCAB, size=n).tolist()  # from 3: skip the pad/bos/eos ids

    prefix = tok(48)
    return [
        tok(5),
        prefix + tok(12),
        tok(33),
        prefix + tok(42),
        tok(120),
        prefix + tok(2),
        tok(77),
        prefix + tok(72 - 5),
    ]


@dataclass
class HFGreedy:
    tokens: list[int]  # the new tokens
    min_margin: float  # smallest top-1 minus top-2 logit over the generated steps


def hf_generate(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, output_logits: bool = True, past_key_values: Any = None
):
    """The HF greedy oracle: generate() on a batch of equal-length prompts (no padding, no attention mask
    to get wrong), exactly new_tokens each (EOS ignored), with no sampling knob from generation_config.
    The tests' references and the benchmarks' checks (benchmarks/common.py) both call it; `past_key_values`
    (a fresh cache) stands in for generate's own (benchmarks/checks/hf_fp8_rounding.py)."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=output_logits,
            return_dict_in_generate=True,
            past_key_values=past_key_values,
            temperature=None,
            top_p=None,
            top_k=None,
        )


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> HFGreedy:
    """HF's greedy continuation of one prompt (no padding, no EOS stop), with its logit margin."""
    out = hf_generate(model, torch.tensor([prompt]), max_new_tokens)
    new = out.sequences[0, len(prompt) :].tolist()
    margins = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return HFGreedy(new, min(margins))


def greedy_references(make_dir, new_tokens: int):
    """family -> (model dir, prompts, HF greedy tokens per prompt), built lazily once per family.

    Fails on a numerical tie (HF's top-2 logit margin below TIE_MARGIN): such a reference can't tell a
    bug from rounding. `make_dir(name)` makes a fresh directory (pytest's tmp_path_factory.mktemp).
    """
    cache: dict[str, tuple[str, list[list[int]], list[list[int]]]] = {}

    def get(family: str):
        if family not in cache:
            path = str(make_dir(family))
            model = save_hf_model(family, path)
            prompts = make_prompts()
            refs = [hf_greedy(model, p, new_tokens) for p in prompts]
            for i, r in enumerate(refs):
                assert r.min_margin >= TIE_MARGIN, (
                    f"{family} prompt {i}: HF's top-2 logit margin {r.min_margin:.2e} < {TIE_MARGIN}: "
                    f"a numerical tie, not a usable reference; change the seed/init"
                )
            cache[family] = (path, prompts, [r.tokens for r in refs])
        return cache[family]

    return get
