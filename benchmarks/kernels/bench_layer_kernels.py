"""Fused layer kernels against the torch layers they replace, side by side in one run (bf16).

Per op at T=256 tokens, for the Qwen3-0.6B and Llama-3.1-8B shapes: RMSNorm with the residual add,
q/k norm + rotary (from the QKV output, including the .contiguous() copies the torch path makes) and
SiLU-and-mul. Then one whole decoder layer at decode batch 256 (short contexts, paged KV cache,
Triton attention in both), torch layers vs Triton layers. Everything is timed as CUDA-graph replay
(the decode regime, where a tiny kernel costs its launch slot), reported as the median in us. Each
op also reports how many bf16 outputs are bit-identical to the torch path's.

  python -m benchmarks.kernels.bench_layer_kernels            # GPU, appends to results/bench_layer_kernels.jsonl
  python -m benchmarks.kernels.bench_layer_kernels --smoke    # CPU, tiny shapes, Triton interpreter: errors only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from actors.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from actors.layers.attention import Attention
from actors.layers.rotary import RotaryEmbedding
from actors.models.args import parse_args
from actors.models.decoder import DecoderLayer, DecoderMLP, attention_layer_name
from benchmarks.common import SHAPES, record

SCRIPT = "bench_layer_kernels"
TINY = {  # smoke-mode stand-ins of the two shapes
    "qwen3-0.6b": dict(
        SHAPES["qwen3-0.6b"],
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    ),
    "llama-3.1-8b": dict(
        SHAPES["llama-3.1-8b"],
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling=dict(SHAPES["llama-3.1-8b"]["rope_scaling"], original_max_position_embeddings=64),
    ),
}
BLOCK_SIZE = 16


def bench(fn: Callable[[], object], smoke: bool) -> float:
    """Median microseconds of fn replayed from a CUDA graph (one wall-clock run on the CPU)."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def exact_rate(a: Any, b: Any) -> float:
    """Fraction of outputs bit-identical to the torch path's (a, b tensors or tuples of them)."""
    pairs = list(zip(a, b, strict=True)) if isinstance(a, tuple) else [(a, b)]
    same = sum(int((x == y).sum()) for x, y in pairs)
    return same / sum(x.numel() for x, _ in pairs)


def build_layer(cfg: dict, device: str, dtype: torch.dtype) -> DecoderLayer:
    """Layer 0 of the shape with random weights; built "triton", switched per run by set_backend."""
    qk_norm = cfg["model_type"] == "qwen3"
    args = parse_args(
        cfg,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=qk_norm,
        layer_windows=[None] * cfg["num_hidden_layers"],
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.device(device):
        rotary = RotaryEmbedding(args.head_dim, args.max_position, args.rope, "triton")
        layer = DecoderLayer(args, 0, rotary, dtype, "triton", DecoderMLP(args, dtype, "triton"))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise * p.shape[-1] ** -0.5)
    return layer


def set_backend(layer: torch.nn.Module, backend: str) -> None:
    """Switch norm/rotary/activation (and the attention block's q/k handling) between the torch ops
    and the fused kernels; paged attention itself stays Triton, the only capturable kind."""
    for module in layer.modules():
        if hasattr(module, "backend") and not isinstance(module, Attention):
            module.backend = backend


def run_ops(
    shape: str, cfg: dict, layer: DecoderLayer, tokens: int, smoke: bool, device: str, dtype: torch.dtype
) -> None:
    attn = layer.self_attn
    hq, hkv, d = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads, attn.head_dim
    x, res = (torch.randn(tokens, cfg["hidden_size"], device=device, dtype=dtype) for _ in range(2))
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=device, dtype=dtype)
    gate_up = 2 * torch.randn(tokens, 2 * cfg["intermediate_size"], device=device, dtype=dtype)
    positions = torch.randint(0, 200 if smoke else 4096, (tokens,), device=device)

    def qk_norm_rope() -> Any:
        """DecoderAttention.forward up to attention: the torch path with its .contiguous() copies,
        or the fused kernel reading q/k in place (v stays a view)."""
        q, k, v = attn.qkv_proj.split(qkv)
        if attn.backend == "triton":
            return (*attn.rotary_emb.forward_fused(positions, q, k, attn.qk_norm_args()), v)
        if attn.q_norm is not None:
            q = attn.q_norm(q.reshape(tokens, -1, d)).view(tokens, -1)
            k = attn.k_norm(k.reshape(tokens, -1, d)).view(tokens, -1)
        return (*attn.rotary_emb(positions, q.contiguous(), k.contiguous()), v.contiguous())

    ops = {
        "rmsnorm+residual": lambda: layer.post_attention_layernorm(x, res),
        "qk-norm+rope" if attn.q_norm is not None else "rope": qk_norm_rope,
        "silu-mul": lambda: layer.mlp.act_fn(gate_up),
    }
    for name, fn in ops.items():
        results, times = {}, {}
        for backend in ("torch", "triton"):
            set_backend(layer, backend)
            with torch.no_grad():
                out = fn()
                results[backend] = tuple(out[:2]) if isinstance(out, tuple) else out
                times[backend] = bench(fn, smoke)
        rate = exact_rate(results["triton"], results["torch"])
        print(
            f"{shape:13s} {name:17s} T={tokens}: torch {times['torch']:8.1f} us  triton "
            f"{times['triton']:8.1f} us  x{times['torch'] / times['triton']:5.2f}  "
            f"bit-exact {100 * rate:.4f}%",
            flush=True,
        )
        if not smoke:
            key = f"{shape}_{name.replace('+', '_').replace('-', '_')}_t{tokens}"
            record(SCRIPT, f"{key}_speedup", times["torch"] / times["triton"], "ratio")
            record(SCRIPT, f"{key}_bf16_exact", rate, "fraction")


def decode_metadata(batch: int, context: int, device: str) -> tuple[AttentionMetadata, int]:
    """Decode step of `batch` sequences at `context` tokens each, blocks scattered over the pool."""
    pages = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * pages + 1
    gen = torch.Generator(device="cpu").manual_seed(1)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, pages).to(torch.int32)
    last = context - 1
    slots = table[:, last // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + last % BLOCK_SIZE
    md = AttentionMetadata(
        num_actual_tokens=batch,
        num_reqs=batch,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=slots.to(device),
    )
    return md, num_blocks


def run_layer(
    shape: str, layer: DecoderLayer, batch: int, context: int, smoke: bool, device: str, dtype: torch.dtype
) -> None:
    attn = layer.self_attn.attn
    md, num_blocks = decode_metadata(batch, context, device)
    attn.kv_cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_size, device=device, dtype=dtype
    )
    ctx = ForwardContext({0: md}, {attention_layer_name(0): 0})
    hidden_size = layer.input_layernorm.weight.shape[0]
    hidden, residual = (torch.randn(batch, hidden_size, device=device, dtype=dtype) for _ in range(2))
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)

    def step() -> Any:
        with torch.no_grad(), set_forward_context(ctx):
            return layer(positions, hidden, residual)

    times, outs = {}, {}
    for backend in ("torch", "triton"):
        set_backend(layer, backend)
        outs[backend] = step()
        times[backend] = bench(step, smoke)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs["triton"], outs["torch"], strict=True))
    print(
        f"{shape:13s} decoder layer  B={batch} ctx={context}: torch {times['torch']:8.1f} us  "
        f"triton {times['triton']:8.1f} us  x{times['torch'] / times['triton']:5.2f}  "
        f"max |diff| {diff:.3g}",
        flush=True,
    )
    if not smoke:
        record(SCRIPT, f"{shape}_layer_decode_b{batch}_torch_us", times["torch"], "us")
        record(SCRIPT, f"{shape}_layer_decode_b{batch}_triton_us", times["triton"], "us")
        record(SCRIPT, f"{shape}_layer_decode_b{batch}_speedup", times["torch"] / times["triton"], "ratio")
    attn.kv_cache = None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no results recorded")
    ap.add_argument("--only", choices=["ops", "layer"], default=None)
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_layer_kernels needs a CUDA GPU (use --smoke on the CPU)")
    device, dtype = ("cpu" if args.smoke else "cuda"), torch.bfloat16
    tokens, batch, context = (2, 2, 24) if args.smoke else (256, 256, 128)
    torch.manual_seed(0)
    for shape in ("qwen3-0.6b", "llama-3.1-8b"):
        cfg = (TINY if args.smoke else SHAPES)[shape]
        layer = build_layer(cfg, device, dtype)
        if args.only in (None, "ops"):
            run_ops(shape, cfg, layer, tokens, args.smoke, device, dtype)
        if args.only in (None, "layer"):
            run_layer(shape, layer, batch, context, args.smoke, device, dtype)
        del layer
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
