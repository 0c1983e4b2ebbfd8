"""Shared helpers for the benchmark scripts: result records and random-weight model directories."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"

# HF config fields of the model shapes the benchmarks use (random weights, real sizes).
SHAPES = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
    # Mistral-7B-v0.1: Llama's layout with one sliding window (4096) on every layer (v0.3 drops it).
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        sliding_window=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    # Hybrid attention: 40 local (window 1024, base 1e4) and 8 global layers (base 1e6, linear x8).
    "gemma-3-12b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
        max_position_embeddings=131072,
        sliding_window=1024,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    # Soft-capped attention and logits, every second layer local (window 4096).
    "gemma-2-2b": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=256000,
        max_position_embeddings=8192,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    # Mixture of experts: 128 experts of 768, top 8, renormalised.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    # Mixtral's layout (8 experts, top 2, float32 routing weights) at a small size.
    "mixtral-small": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
}

# --smoke: every shape shrunk to a CPU-sized model of the same family (same layer kinds and routing).
TINY_FIELDS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)
TINY_OPTIONAL = dict(
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=16,
    query_pre_attn_scalar=16,
    sliding_window_pattern=2,
)


def vocab_size(shape: str) -> int:
    value = SHAPES[shape]["vocab_size"]
    assert isinstance(value, int)
    return value


def tiny_shape(shape: str) -> dict:
    fields = dict(SHAPES[shape], **TINY_FIELDS)
    fields.update({k: v for k, v in TINY_OPTIONAL.items() if k in SHAPES[shape]})
    return fields


def git_commit() -> str:
    """KVRAY_COMMIT when set (GPU runs work on a copy of the tree, whose .git may be stale or absent),
    else the checkout's HEAD."""
    if os.environ.get("KVRAY_COMMIT"):
        return os.environ["KVRAY_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def command_line() -> str:
    """How to run this process again: `python -m benchmarks.<folder>.<script> ARGS` for a benchmark script
    (run as a module or by path), else the argv as given."""
    argv0 = Path(sys.argv[0]).resolve()
    if argv0.suffix == ".py" and argv0.is_relative_to(ROOT / "benchmarks"):
        module = ".".join(argv0.relative_to(ROOT).with_suffix("").parts)
        return " ".join(["python", "-m", module, *sys.argv[1:]])
    return " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


# Variables of bookkeeping and logging (the runner's, a device call's, the compile log); every other
# KVRAY_* one may change what the engine does.
RUNNER_ENV = {"KVRAY_COMMIT", "KVRAY_SUITE", "KVRAY_RESULTS_MIRROR", "KVRAY_LOG_COMPILES", "KVRAY_VERBOSE"}


def rounded(value: float) -> float:
    """4 decimals, or 4 significant digits below 0.01 (a logprob gap of 5e-7 nats stays visible)."""
    return round(value, 4) if abs(value) >= 0.01 or value == 0 else float(f"{value:.4g}")


def record(script: str, metric: str, value: float, unit: str, device: str | None = None) -> dict:
    """Append one headline figure to benchmarks/results/<script>.jsonl: the one writer of every series.

    Also appended to the same file name in $OUT (what a device call brings back) and in
    $KVRAY_RESULTS_MIRROR (a folder in /tmp that outlives the calls on one warm machine: the vs-vllm suite's
    kvray side, vLLM side and ratio step read each other's figures there). `device` names a host-side
    figure's CPU; by default the CUDA device, or "cpu"."""
    rec = {
        "metric": metric,
        "value": rounded(float(value)),
        "unit": unit,
        "device": device or device_name(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "command": command_line(),
    }
    if os.environ.get("KVRAY_SUITE"):
        rec["suite"] = os.environ["KVRAY_SUITE"]
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVRAY_") and k not in RUNNER_ENV}
    if switches:  # an A/B switch (KVRAY_FUSED_KV_WRITE=0, ...) made this figure: it says so
        rec["env"] = switches
    dirs = [RESULTS_DIR] + [Path(os.environ[k]) for k in ("OUT", "KVRAY_RESULTS_MIRROR") if os.environ.get(k)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"{script}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
    print("RESULT", json.dumps(rec), flush=True)
    return rec


def latest(folder: Path, script: str, metric: str) -> dict | None:
    """The last record of `metric` in <folder>/<script>.jsonl made with the engine's defaults (no `env`
    switch: an A/B run's figure never stands for the default's), or None."""
    path = folder / f"{script}.jsonl"
    if not path.exists():
        return None
    found = None
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("metric") == metric and not rec.get("env"):
                found = rec
    return found


def make_random_model(
    shape: str, out_dir: str, dtype: str = "bfloat16", num_layers: int | None = None, tiny: bool = False
) -> str:
    """Write an HF-format directory with random weights of a named shape (transformers does the init);
    `tiny`: the shape's family at TINY_FIELDS' size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(out_dir) / (shape + ("-tiny" if tiny else "") + (f"-{num_layers}l" if num_layers else "") + f"-{dtype}")
    if (path / "config.json").exists():
        return str(path)
    fields = tiny_shape(shape) if tiny else dict(SHAPES[shape])
    if num_layers:
        fields["num_hidden_layers"] = num_layers
    model_type = fields.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **fields)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    model.save_pretrained(path, safe_serialization=True)
    del model
    return str(path)


def generate_greedy(llm: Any, prompts: list[list[int]], new_tokens: int, label: str) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (EOS ignored) and the seconds generate() took; shuts the LLM down.
    A failed request or a short output raises, naming `label` and the request."""
    from cluster import SamplingParams

    try:
        t0 = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
        )
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = []
    for i, o in enumerate(outs):
        if o.error is not None:
            raise RuntimeError(f"{label}: request {i} failed: {o.error}")
        tokens.append(list(o.outputs[0].token_ids))
        if len(tokens[-1]) != new_tokens:
            raise RuntimeError(f"{label}: request {i} produced {len(tokens[-1])} tokens, not {new_tokens}")
    return tokens, elapsed


def hf_greedy_by_length(
    model: Any,
    prompts: list[list[int]],
    new_tokens: int,
    device: str,
    output_logits: bool,
    new_cache: Callable[[], Any] | None = None,
) -> Iterator[tuple[int, Any, int]]:
    """HF's greedy oracle (tests/hf_models.hf_generate) over prompts of mixed lengths: one batch per run of
    equal-length prompts, so that no pad token or attention mask enters. Yields (index of the run's first
    prompt, generate's output, the prompt length). `new_cache` makes each batch's KV cache (None: HF's own)."""
    import torch

    from tests.hf_models import hf_generate

    i = 0
    while i < len(prompts):
        j = i
        while j < len(prompts) and len(prompts[j]) == len(prompts[i]):
            j += 1
        ids = torch.tensor(prompts[i:j], device=device)
        cache = None if new_cache is None else new_cache()
        yield i, hf_generate(model, ids, new_tokens, output_logits, past_key_values=cache), ids.shape[1]
        i = j


def add_byte_tokenizer(model_dir: str, vocab_size: int, seed: int = 0) -> None:
    """tokenizer.json for a random-weight model: ids 0..255 are bytes, the rest random 2-6 byte tokens."""
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        return
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from actors.models.tiny_random import _byte_alphabet

    alphabet = _byte_alphabet()
    printable = [alphabet[b] for b in range(32, 127)]
    vocab = {ch: b for b, ch in alphabet.items()}
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        vocab.setdefault("".join(rng.choice(printable) for _ in range(rng.randint(2, 6))), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(path)


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device copy bandwidth in GB/s: bytes read plus bytes written per second, median of `reps` copies."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV cache from the free memory: give the 2 GiB back
    return 2 * nbytes / statistics.median(times) / 1e9
