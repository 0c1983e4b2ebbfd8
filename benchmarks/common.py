"""Shared helpers for the benchmark scripts: result records and random-weight model directories."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# HF config fields of the model shapes the benchmarks use (random weights, real sizes).
SHAPES = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_act="silu"),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        hidden_act="silu", rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
}


def git_commit() -> str:
    """KVRAY_COMMIT when set (GPU runs work on a copy of the tree, whose .git may be stale or absent),
    else the checkout's HEAD."""
    if os.environ.get("KVRAY_COMMIT"):
        return os.environ["KVRAY_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return os.environ.get("KVRAY_COMMIT", "unknown")


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def record(script: str, metric: str, value: float, unit: str) -> dict:
    """Append one headline figure to benchmarks/results/<script>.jsonl (and $OUT when set)."""
    rec = {"metric": metric, "value": round(float(value), 4), "unit": unit, "device": device_name(),
           "commit": git_commit(), "date": datetime.date.today().isoformat(),
           "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for d in [RESULTS_DIR] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        with open(d / f"{script}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
    print("RESULT", json.dumps(rec), flush=True)
    return rec


def make_random_model(shape: str, out_dir: str, dtype: str = "bfloat16", num_layers: int | None = None) -> str:
    """Write an HF-format directory with random weights of a named shape (transformers does the init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(out_dir) / (shape + (f"-{num_layers}l" if num_layers else "") + f"-{dtype}")
    if (path / "config.json").exists():
        return str(path)
    fields = dict(SHAPES[shape])
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


def generate_greedy(llm, prompts: list[list[int]], new_tokens: int, label: str) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (EOS ignored) and the seconds generate() took; shuts the LLM down.
    A failed request or a short output raises, naming `label` and the request."""
    import time

    from cluster import SamplingParams

    try:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
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
