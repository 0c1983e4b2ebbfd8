"""Paged attention kernels on the GPU: decode bandwidth and prefill against SDPA, side by side.

Decode: bf16, 32 query / 8 KV heads, head 128, block 16, batches 1/32/128/256 x contexts 1k/4k/16k
(combos over ~40 GB skipped), blocks scattered at random over the pool as a busy engine leaves them.
Reported as time and as the fraction of the device's copy bandwidth (measured at the start: bytes read
plus written by a 1 GiB device copy), counting the bytes of K/V read plus Q read plus O written. Until
2026-12-07 the fraction was of a fixed 4,277 GB/s (an H200's copy), so earlier H100 fractions read ~30%
low.
Prefill: 4 sequences x 2,048 new tokens on 2,048 cached, against torch SDPA (flash) on the same
tokens in contiguous memory with a bottom-right causal mask. Timed with CUDA-graph replay.

  python -m benchmarks.kernels.bench_attention            # GPU, appends to results/bench_attention.jsonl
  python -m benchmarks.kernels.bench_attention --smoke    # CPU, tiny shapes, Triton interpreter: errors only
  python -m benchmarks.kernels.bench_attention --kv-cache-dtype fp8   # K/V stored in fp8 (metrics *_fp8kv)
  python -m benchmarks.kernels.bench_attention --only decode-nano --kv-layout NHD HND   # page layouts, A/B

Decode at nano's shape (`decode-nano`): Qwen3-0.6B's 16 query / 8 KV heads, 256 sequences at contexts drawn
uniformly from 100-2,048 (the nano recipe's mix of prompt and output lengths), block 16.
--kv-layout runs the decodes once per page layout (kvcore/kernels/kv_layout.py; metrics *_hnd for HND).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from benchmarks.common import copy_bandwidth_gbs, record
from kvcore.kernels.fp8 import FP8_KV_DTYPES
from kvcore.kernels.kv_layout import KV_LAYOUTS, kv_layout, paged_kv_view
from kvcore.kernels.ops import paged_attention

SCRIPT = "bench_attention"
# --kv-cache-dtype: the caches' dtype (None: the query's); --kv-layout: their page layout
CACHE: dict = {"dtype": None, "suffix": "", "layout": "NHD"}


@functools.lru_cache(maxsize=None)
def copy_gbps(device: str) -> float:
    """The device's copy bandwidth (GB/s), measured once: the ceiling the fractions are of."""
    return copy_bandwidth_gbs(device, nbytes=1 << 24 if device == "cpu" else 1 << 30)


def metric(name: str) -> str:
    """The metric's name for the caches benchmarked: *_fp8kv for an fp8 cache, *_hnd for HND pages."""
    return name + CACHE["suffix"] + ("_hnd" if CACHE["layout"] == "HND" else "")


def make_paged(
    q_lens: list[int],
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random paged batch: each sequence's blocks are a random subset of the pool (block 0, the
    null block, never used)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = [(s + bs - 1) // bs for s in seq_lens]
    num_blocks = sum(pages) + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    memory = torch.randn(2 * num_blocks * bs * hkv * d, dtype=dtype, device=device)
    if CACHE["dtype"] is not None:
        memory = memory.to(CACHE["dtype"])  # N(0, 1) values: scale 1 as vLLM without checkpoint scales
    kv = paged_kv_view(memory, num_blocks, bs, hkv, d, CACHE["layout"])
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype, device=device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q, kv[0], kv[1], qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32).to(device), table.to(device))


def bench(fn: Callable[[], object], smoke: bool) -> float:
    """Median milliseconds of fn (CUDA-graph replay on the GPU; one wall-clock run on the CPU)."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200)


def check(fn_out: torch.Tensor, ref_out: torch.Tensor, what: str, tol: float) -> None:
    err = (fn_out.float() - ref_out.float()).abs().max().item()
    if not err <= tol:
        raise SystemExit(f"{what}: max abs error {err} vs the torch reference exceeds {tol}")


def run_decode(args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
    hq, hkv, d, bs = (4, 2, 32, 16) if args.smoke else (32, 8, 128, 16)  # smoke: the interpreter runs it
    batches, contexts = ([3], [40]) if args.smoke else ([1, 32, 128, 256], [1024, 4096, 16384])
    for b in batches:
        for ctx in contexts:
            kv_bytes = 2 * b * ctx * hkv * d * (CACHE["dtype"] or dtype).itemsize
            if kv_bytes > 40e9:
                print(f"decode B={b} ctx={ctx}: skipped ({kv_bytes / 1e9:.0f} GB of KV)")
                continue
            q, kc, vc, qsl, sl, bt = make_paged([1] * b, [ctx] * b, hq, hkv, d, bs, dtype, device)
            out = torch.empty_like(q)
            scale = d**-0.5

            fn = functools.partial(paged_attention, q, kc, vc, out, qsl, sl, bt, scale, None, 1, ctx, backend="triton")

            if b <= 32:
                ref = torch.empty_like(q)
                paged_attention(q, kc, vc, ref, qsl, sl, bt, scale, None, backend="torch")
                fn()
                check(out, ref, f"decode B={b} ctx={ctx}", 2e-2)
            ms = bench(fn, args.smoke)
            moved = kv_bytes + 2 * q.numel() * dtype.itemsize
            frac = moved / (ms * 1e-3) / 1e9 / copy_gbps(device)
            print(
                f"decode {CACHE['layout']} B={b:4d} ctx={ctx:6d}: {ms * 1e3:9.1f} us  "
                f"{moved / (ms * 1e-3) / 1e9:7.0f} GB/s  {100 * frac:5.1f}% of copy",
                flush=True,
            )
            if not args.smoke and b == 128 and ctx == 4096:
                record(SCRIPT, metric("attn_decode_bw_frac_b128_c4096"), frac, "fraction")
                record(SCRIPT, metric("attn_decode_us_b128_c4096"), ms * 1e3, "us")
            q = kc = vc = out = None  # free this size's KV before the next (a del would unbind fn's closure)
            if device == "cuda":
                torch.cuda.empty_cache()


def run_decode_nano(args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
    """Decode at the nano recipe's shape: Qwen3-0.6B's heads, 256 sequences at mixed contexts, each
    sequence's pages scattered over the pool as a busy engine leaves them."""
    hq, hkv, d, bs = (4, 2, 32, 16) if args.smoke else (16, 8, 128, 16)
    b, lo, hi = (3, 5, 40) if args.smoke else (256, 100, 2048)
    g = torch.Generator().manual_seed(3)
    ctxs = torch.randint(lo, hi + 1, (b,), generator=g).tolist()
    q, kc, vc, qsl, sl, bt = make_paged([1] * b, ctxs, hq, hkv, d, bs, dtype, device)
    out = torch.empty_like(q)
    scale = d**-0.5
    fn = functools.partial(paged_attention, q, kc, vc, out, qsl, sl, bt, scale, None, 1, max(ctxs), backend="triton")
    ref = torch.empty_like(q)
    paged_attention(q, kc, vc, ref, qsl, sl, bt, scale, None, backend="torch")
    fn()
    check(out, ref, f"decode-nano {CACHE['layout']}", 2e-2)
    ms = bench(fn, args.smoke)
    moved = 2 * sum(ctxs) * hkv * d * kc.element_size() + 2 * q.numel() * dtype.itemsize
    frac = moved / (ms * 1e-3) / 1e9 / copy_gbps(device)
    print(
        f"decode-nano {CACHE['layout']} B={b} ctx {lo}-{hi} (mean {sum(ctxs) / b:.0f}): {ms * 1e3:9.1f} us  "
        f"{moved / (ms * 1e-3) / 1e9:7.0f} GB/s  {100 * frac:5.1f}% of copy",
        flush=True,
    )
    if not args.smoke:
        record(SCRIPT, metric("attn_decode_us_nano"), ms * 1e3, "us")
        record(SCRIPT, metric("attn_decode_bw_frac_nano"), frac, "fraction")


def sdpa_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D]: causal with the queries at the end (bottom right)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]

    def fn() -> Any:
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return fn


def run_prefill(args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
    hq, hkv, d, bs = 32, 8, 128, 16
    nseq, new, cached = (2, 24, 20) if args.smoke else (4, 2048, 2048)
    if args.smoke:
        hq, hkv, d = 4, 2, 32
    total = new + cached
    q, kc, vc, qsl, sl, bt = make_paged([new] * nseq, [total] * nseq, hq, hkv, d, bs, dtype, device, seed=1)
    out = torch.empty_like(q)
    scale = d**-0.5

    def paged() -> Any:
        paged_attention(q, kc, vc, out, qsl, sl, bt, scale, None, new, total, backend="triton")

    # The same tokens, gathered into contiguous [B, H, L, D] tensors for SDPA (in the query's dtype).
    pages = bt.long()
    kd = kc[pages].flatten(1, 2)[:, :total].transpose(1, 2).to(dtype).contiguous()
    vd = vc[pages].flatten(1, 2)[:, :total].transpose(1, 2).to(dtype).contiguous()
    qd = q.view(nseq, new, hq, d).transpose(1, 2).contiguous()
    sdpa = sdpa_contiguous(qd, kd, vd)
    paged()
    check(out.view(nseq, new, hq, d).transpose(1, 2), sdpa(), "prefill vs SDPA", 3e-2)
    t_paged, t_sdpa = bench(paged, args.smoke), bench(sdpa, args.smoke)
    # Multiply-adds of QK^T and PV over the visible (query, key) pairs, bottom-right causal.
    pairs = sum(cached + i + 1 for i in range(new)) * nseq * hq
    flop = 4 * d * pairs
    print(
        f"prefill {nseq}x{new} on {cached} cached: paged {t_paged:.3f} ms "
        f"({flop / t_paged / 1e9:.1f} TFLOP/s), SDPA {t_sdpa:.3f} ms "
        f"({flop / t_sdpa / 1e9:.1f} TFLOP/s), ratio {t_paged / t_sdpa:.2f}",
        flush=True,
    )
    if not args.smoke:
        record(SCRIPT, metric("attn_prefill_vs_sdpa_ratio"), t_paged / t_sdpa, "ratio")
        record(SCRIPT, metric("attn_prefill_tflops"), flop / t_paged / 1e9, "TFLOP/s")


def run_mixed(args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
    """A continuous-batching step: one prefill chunk next to many decodes, against the same work
    as two separate calls (the kernel should not lose by mixing them)."""
    hq, hkv, d, bs = (4, 2, 32, 16) if args.smoke else (32, 8, 128, 16)
    new, ndec, ctx = (24, 3, 50) if args.smoke else (2048, 127, 4096)
    scale = d**-0.5
    calls = {}
    for name, q_lens, seq_lens in (
        ("mixed", [new] + [1] * ndec, [new] + [ctx] * ndec),
        ("decodes", [1] * ndec, [ctx] * ndec),
        ("prefill", [new], [new]),
    ):
        q, kc, vc, qsl, sl, bt = make_paged(q_lens, seq_lens, hq, hkv, d, bs, dtype, device, 2)
        out = torch.empty_like(q)

        mq, ms = max(q_lens), max(seq_lens)
        fn = functools.partial(paged_attention, q, kc, vc, out, qsl, sl, bt, scale, None, mq, ms, backend="triton")
        calls[name] = bench(fn, args.smoke)
    print(
        f"mixed step (1x{new} prefill + {ndec} decodes at {ctx}): {calls['mixed'] * 1e3:.1f} us; "
        f"separately {calls['decodes'] * 1e3:.1f} + {calls['prefill'] * 1e3:.1f} us",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no results recorded")
    ap.add_argument("--only", choices=["decode", "decode-nano", "prefill", "mixed"], default=None)
    ap.add_argument(
        "--kv-layout", nargs="+", choices=KV_LAYOUTS, help="page layouts to run, in turn (default: the engine's)"
    )
    ap.add_argument("--kv-cache-dtype", choices=["auto", *FP8_KV_DTYPES], default="auto")
    args = ap.parse_args(argv)
    if args.kv_cache_dtype != "auto":
        CACHE.update(dtype=FP8_KV_DTYPES[args.kv_cache_dtype], suffix=f"_{args.kv_cache_dtype}kv")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU (use --smoke on the CPU)")
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.bfloat16
    torch.manual_seed(0)
    for layout in args.kv_layout or [kv_layout()]:
        CACHE["layout"] = layout
        if args.only in (None, "decode"):
            run_decode(args, device, dtype)
        if args.only in (None, "decode-nano"):
            run_decode_nano(args, device, dtype)
        if args.only in (None, "prefill"):
            run_prefill(args, device, dtype)
        if args.only in (None, "mixed"):
            run_mixed(args, device, dtype)


if __name__ == "__main__":
    main()
