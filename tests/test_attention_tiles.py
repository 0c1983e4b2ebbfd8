"""The decode tiles' override (KVRAY_DECODE_TILES): what it parses, what it refuses, and that a launch
with the overridden tiles still matches the torch reference under the interpreter. The decode order's
gate (KVRAY_DECODE_ORDER): which batches launch longest first. The register prefetch of the next KV tile
(KVRAY_DECODE_PREFETCH): a decode loop of another structure, held to the same reference."""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels.attention_tiles import (
    DECODE_ORDER_ENV,
    DECODE_PREFETCH_ENV,
    DECODE_TILES_ENV,
    decode_prefetch,
    decode_tiles_override,
    longest_first_max_seqs,
    small_tiles,
)
from kvcore.kernels.ops import paged_attention


def test_default_and_override(monkeypatch):
    monkeypatch.delenv(DECODE_TILES_ENV, raising=False)
    t = small_tiles(4, 128, 2)
    assert (t.block_m, t.block_n, t.num_warps, t.num_stages) == (16, 128, 4, 3)
    monkeypatch.setenv(DECODE_TILES_ENV, "64:4:2")
    t = small_tiles(4, 128, 2)
    assert (t.block_m, t.block_n, t.num_warps, t.num_stages) == (16, 64, 4, 2)
    # head 256 in float32 keeps its wide-row tiles: the override is for the bandwidth-bound common case
    assert small_tiles(2, 256, 4).block_n == 32


@pytest.mark.parametrize("bad", ["64", "64:4", "48:4:2", "64:3:2", "64:4:0", "a:b:c"])
def test_bad_override_names_the_variable(bad):
    with pytest.raises(ValueError, match=DECODE_TILES_ENV):
        decode_tiles_override(bad)


def test_overridden_tiles_match_the_reference(monkeypatch):
    monkeypatch.setenv(DECODE_TILES_ENV, "32:4:2")
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, bs, nblocks = 3, 4, 2, 32, 16, 18
    seq = torch.tensor([5, 40, 77], dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=g)
    kc = torch.randn(nblocks, bs, hkv, d, generator=g)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g)
    bt = torch.randperm(nblocks, generator=g)[: b * 6].view(b, 6).to(torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    args = (qsl, seq, bt, d**-0.5, None)
    paged_attention(q, kc, vc, ref, *args, backend="torch")
    paged_attention(q, kc, vc, out, *args, backend="triton")
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_prefetch_switch(monkeypatch):
    monkeypatch.delenv(DECODE_PREFETCH_ENV, raising=False)
    assert not decode_prefetch() and not small_tiles(2, 128, 2).prefetch
    monkeypatch.setenv(DECODE_PREFETCH_ENV, "1")
    assert small_tiles(2, 128, 2).prefetch
    monkeypatch.setenv(DECODE_PREFETCH_ENV, "yes")
    with pytest.raises(ValueError, match=DECODE_PREFETCH_ENV):
        decode_prefetch()


@pytest.mark.parametrize("cache", ["float32", "fp8"])
@pytest.mark.parametrize("window", [None, 20])
def test_prefetched_decode_matches_the_reference(monkeypatch, cache, window):
    """16-wide tiles, so each sequence crosses several tiles, the last one partial; a window starts the
    loop mid-sequence; split-KV gives each split its own prefetch chain."""
    from kvcore.kernels.fp8 import quantize_ref
    from kvcore.kernels.paged_attention import paged_attention_triton

    monkeypatch.setenv(DECODE_PREFETCH_ENV, "1")
    monkeypatch.setenv(DECODE_TILES_ENV, "16:4:1")
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, d, bs, nblocks = 3, 4, 2, 32, 8, 40
    seq = torch.tensor([5, 41, 77], dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=g)
    kc = torch.randn(nblocks, bs, hkv, d, generator=g)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g)
    if cache == "fp8":
        kc, vc = quantize_ref(kc, 1.0, torch.float8_e4m3fn), quantize_ref(vc, 1.0, torch.float8_e4m3fn)
    bt = torch.randperm(nblocks, generator=g)[: b * 10].view(b, 10).to(torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    ref = torch.empty_like(q)
    args = (qsl, seq, bt, d**-0.5, window)
    paged_attention(q, kc.float(), vc.float(), ref, *args, backend="torch")
    for splits in (1, 2):
        out = torch.empty_like(q)
        paged_attention_triton(q, kc, vc, out, *args, max_query_len=1, max_seq_len=77, num_splits=splits)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_pick_decode_tiles_sums_unsplit_large_batches():
    from benchmarks.kernels.bench_attention_splits import TILES
    from benchmarks.tools.pick_decode_tiles import pick

    rows = [
        {"shape": "llama-3.1-8b", "b": 256, "us": {"default/s1": 100, "n64s2/s1": 80, "n32s3/s1": 70, "n64s2/s2": 1}},
        {"shape": "llama-3.1-8b", "b": 128, "us": {"default/s1": 50, "n64s2/s1": 40, "n32s3/s1": 60}},
        {"shape": "llama-3.1-8b", "b": 32, "us": {"n64s2/s1": 900, "n32s3/s1": 1}},  # below --min-batch
        {"shape": "qwen3-0.6b", "b": 256, "us": {"n64s2/s1": 900}},  # another shape
    ]
    value, totals = pick(rows, "llama-3.1-8b", 128, TILES)
    assert totals == {"n64s2": 120, "n32s3": 130}
    assert value == "64:4:2"


def test_longest_first_only_for_batches_of_few_waves(monkeypatch):
    monkeypatch.delenv(DECODE_ORDER_ENV, raising=False)
    # H200: 132 SMs, 8 KV heads a rank -> at most 4 programs an SM -> 66 sequences
    assert longest_first_max_seqs(8, 132) == 66
    assert longest_first_max_seqs(2, 132) == 264
    monkeypatch.setenv(DECODE_ORDER_ENV, "grid")
    assert longest_first_max_seqs(8, 132) == 0
    monkeypatch.setenv(DECODE_ORDER_ENV, "sorted")
    with pytest.raises(ValueError, match=DECODE_ORDER_ENV):
        longest_first_max_seqs(8, 132)
