"""Attention kernels: Triton reshape_and_cache and paged attention against the torch references,
and the reference against an independent dense oracle (SDPA with an explicit mask on contiguous
K/V). Runs under TRITON_INTERPRET=1 on the CPU; with TRITON_INTERPRET=0 on a CUDA machine the same
tests run the compiled kernels on the GPU.

Every paged batch is built so that reading anything outside a sequence's visible range poisons the
output: unused cache slots, the null block and padding positions hold NaN, unused block-table
entries point far outside the pool, and output rows are pre-filled with NaN.
"""

import os

import pytest
import torch

from kvcore.kernels.attention_tiles import choose_num_splits
from kvcore.kernels.kv_layout import KV_LAYOUTS, kv_layout, paged_kv_view
from kvcore.kernels.ops import longest_first, paged_attention, reshape_and_cache
from kvcore.kernels.paged_attention import paged_attention_triton

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] != "1" and torch.cuda.is_available() else "cpu"
PAD_ROWS = 3  # rows of query/out beyond the batch's tokens, which must stay untouched
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def in_layout(key_cache, value_cache, layout):
    """The same logical caches over fresh memory laid out as `layout` (kvcore/kernels/kv_layout.py)."""
    num_blocks, bs, hkv, d = key_cache.shape
    memory = torch.empty(2 * key_cache.numel(), dtype=key_cache.dtype, device=key_cache.device)
    kv = paged_kv_view(memory, num_blocks, bs, hkv, d, layout)
    kv[0].copy_(key_cache)
    kv[1].copy_(value_cache)
    return kv[0], kv[1]


def make_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, window=None, seed=0, layout="NHD"):
    """A paged batch plus each sequence's logical K/V (the oracle's input), its caches laid out as
    `layout`."""
    g = torch.Generator().manual_seed(seed)
    pages = [(s + bs - 1) // bs for s in seq_lens]
    num_blocks = sum(pages) + 4
    key_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    # Unused entries point far outside the pool: a read through them would fault or poison.
    table = torch.full((len(seq_lens) + 1, max(pages) + 2), 10**6, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 = null block
    keys, values = [], []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        k = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
        v = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
        keys.append(k)
        values.append(v)
        # With a window, blocks wholly before the first query's window are the null block.
        first_live = 0 if window is None else max(0, seq_len - q_len - window + 1) // bs
        for p in range(pages[b]):
            if p < first_live:
                table[b, p] = 0
                continue
            blk = free.pop()
            table[b, p] = blk
            n = min(bs, seq_len - p * bs)
            key_cache[blk, :n] = k[p * bs : p * bs + n]
            value_cache[blk, :n] = v[p * bs : p * bs + n]
    key_cache, value_cache = in_layout(key_cache, value_cache, layout)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens + PAD_ROWS, hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    dev = DEVICE
    return dict(
        query=query.to(dev),
        key_cache=key_cache.to(dev),
        value_cache=value_cache.to(dev),
        query_start_loc=qsl.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
        block_table=table.to(dev),
        keys=keys,
        values=values,
        q_lens=q_lens,
        num_tokens=num_tokens,
    )


def dense_oracle(batch, scale, window):
    """SDPA per sequence on contiguous K/V with an explicit bottom-right causal (+window) mask."""
    outs = []
    q_all = batch["query"].cpu().float()
    start = 0
    for q_len, k, v in zip(batch["q_lens"], batch["keys"], batch["values"], strict=True):
        seq_len = k.shape[0]
        q = q_all[start : start + q_len].transpose(0, 1)  # [Hq, Lq, D]
        rep = q.shape[0] // k.shape[1]
        kk = k.float().repeat_interleave(rep, 1).transpose(0, 1)  # [Hq, L, D]
        vv = v.float().repeat_interleave(rep, 1).transpose(0, 1)
        i = torch.arange(seq_len - q_len, seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        mask = j <= i
        if window is not None:
            mask &= j > i - window
        o = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def run_attention(batch, scale, window, backend, kv_scales=(1.0, 1.0), **triton_kw):
    """The batch through the op dispatcher, or straight through the Triton launcher when triton_kw
    (tile or split overrides) are given; kv_scales: an fp8 cache's (k_scale, v_scale)."""
    out = torch.full_like(batch["query"], float("nan"))
    args = (
        batch["query"],
        batch["key_cache"],
        batch["value_cache"],
        out,
        batch["query_start_loc"],
        batch["seq_lens"],
        batch["block_table"][:-1],
        scale,
    )
    max_q, max_s = max(batch["q_lens"]), max(k.shape[0] for k in batch["keys"])
    scales = dict(k_scale=kv_scales[0], v_scale=kv_scales[1])
    if triton_kw:
        paged_attention_triton(*args, window, max_q, max_s, **scales, **triton_kw)
    else:
        paged_attention(*args, sliding_window=window, max_query_len=max_q, max_seq_len=max_s, backend=backend, **scales)
    return out.cpu()


def assert_written_and_untouched(out, num_tokens):
    assert torch.isfinite(out[:num_tokens].float()).all(), "some output rows of real tokens unwritten"
    assert torch.isnan(out[num_tokens:].float()).all(), "rows beyond the batch were written"


# (q_lens, seq_lens): pure prefill, pure decode, mixed with cached prefixes, one long cached chunk.
SHAPES = {
    "prefill": ([17, 9], [17, 9]),
    "decode": ([1, 1, 1, 1], [1, 17, 33, 50]),
    "mixed": ([1, 12, 1, 7], [30, 12, 5, 40]),
    "cached_chunk": ([20], [53]),
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense_oracle(group, window):
    q_lens, seq_lens = SHAPES["mixed"]
    batch = make_batch(q_lens, seq_lens, 2 * group, 2, 16, 4, torch.float32, window)
    out = run_attention(batch, 0.3, window, "torch")
    assert_written_and_untouched(out, batch["num_tokens"])
    torch.testing.assert_close(out[: batch["num_tokens"]], dense_oracle(batch, 0.3, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_triton_matches_reference(kind, group):
    q_lens, seq_lens = SHAPES[kind]
    batch = make_batch(q_lens, seq_lens, 2 * group, 2, 32, 8, torch.float32, seed=group)
    ref = run_attention(batch, 0.2, None, "torch")
    for kw in ({}, dict(block_m=16 * (1 + (group == 4)), block_n=16)):
        out = run_attention(batch, 0.2, None, "triton", **kw)
        assert_written_and_untouched(out, batch["num_tokens"])
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32], equal_nan=True)


@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
def test_triton_bucket_padded_call(kind):
    """As a CUDA graph of a bucket calls it: padding sequences with no tokens after the real ones
    (their query_start_loc entries equal the token count), padding tokens that belong to none, and
    the bucket's host ints (max_query_len = the token count, or 1 for a decode bucket; max_seq_len an
    upper bound). Real tokens equal the unpadded reference; padding rows stay untouched."""
    q_lens, seq_lens = SHAPES[kind]
    batch = make_batch(q_lens, seq_lens, 8, 2, 32, 8, torch.float32, seed=3)
    ref = run_attention(batch, 0.2, None, "torch")
    pad_seqs = 3
    n = batch["num_tokens"]
    qsl = torch.cat([batch["query_start_loc"].cpu(), torch.full((pad_seqs,), n, dtype=torch.int32)])
    lens = torch.cat([batch["seq_lens"].cpu(), torch.zeros(pad_seqs, dtype=torch.int32)])
    table = batch["block_table"].cpu()
    table = torch.cat([table[:-1], torch.zeros(pad_seqs, table.shape[1], dtype=torch.int32)])
    out = torch.full_like(batch["query"], float("nan"))
    max_q = 1 if kind == "decode" else batch["query"].shape[0]
    paged_attention_triton(
        batch["query"],
        batch["key_cache"],
        batch["value_cache"],
        out,
        qsl.to(DEVICE),
        lens.to(DEVICE),
        table.to(DEVICE),
        0.2,
        None,
        max_q,
        4096,
    )
    out = out.cpu()
    assert_written_and_untouched(out, n)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32], equal_nan=True)


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("kind", ["mixed", "cached_chunk", "decode"])
def test_triton_sliding_window(kind, window):
    q_lens, seq_lens = SHAPES[kind]
    batch = make_batch(q_lens, seq_lens, 4, 2, 16, 4, torch.float32, window, seed=window)
    ref = run_attention(batch, 0.25, window, "torch")
    torch.testing.assert_close(ref[: batch["num_tokens"]], dense_oracle(batch, 0.25, window), atol=1e-5, rtol=1e-5)
    out = run_attention(batch, 0.25, window, "triton", block_m=16, block_n=16)
    assert_written_and_untouched(out, batch["num_tokens"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_head_major_pages_give_the_same_bits(kind, splits):
    """HND pages (each KV head's page one contiguous run) hold the same logical cache as NHD: the
    kernels, which address it by strides, give the same bits from either, and the reference agrees."""
    q_lens, seq_lens = SHAPES[kind]
    window = 9 if kind == "mixed" else None
    outs = {}
    for layout in KV_LAYOUTS:
        batch = make_batch(q_lens, seq_lens, 8, 2, 32, 4, torch.float32, window, seed=5, layout=layout)
        assert (batch["key_cache"].stride(2) == 4 * 32) == (layout == "HND")  # a head's rows are adjacent
        outs[layout] = run_attention(batch, 0.2, window, "triton", num_splits=splits)
        assert_written_and_untouched(outs[layout], batch["num_tokens"])
        ref = run_attention(batch, 0.2, window, "torch")
        torch.testing.assert_close(outs[layout], ref, atol=2e-5, rtol=2e-5, equal_nan=True)
    torch.testing.assert_close(outs["HND"], outs["NHD"], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_triton_split_kv(kind, splits, window):
    q_lens, seq_lens = SHAPES[kind]
    batch = make_batch(q_lens, seq_lens, 8, 2, 32, 4, torch.float32, window, seed=splits)
    ref = run_attention(batch, 0.2, window, "torch")
    out = run_attention(batch, 0.2, window, "triton", num_splits=splits, block_m=16, block_n=16)
    assert_written_and_untouched(out, batch["num_tokens"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_longest_first_order_changes_no_result(kind, splits):
    """seq_order only reorders the one-tile launch's programs: the same bits as grid order, and the
    reference's values (the mixed batch also runs the prefill launch, which ignores the order)."""
    q_lens, seq_lens = SHAPES[kind]
    batch = make_batch(q_lens, seq_lens, 8, 2, 32, 4, torch.float32, seed=11)
    order = longest_first(batch["seq_lens"])
    assert order.tolist() == sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    ref = run_attention(batch, 0.2, None, "torch")
    plain = run_attention(batch, 0.2, None, "triton", num_splits=splits)
    ordered = run_attention(batch, 0.2, None, "triton", num_splits=splits, seq_order=order)
    assert_written_and_untouched(ordered, batch["num_tokens"])
    torch.testing.assert_close(ordered, plain, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(ordered, ref, atol=2e-5, rtol=2e-5, equal_nan=True)


def test_seq_order_must_be_an_int32_permutation_shaped_like_seq_lens():
    q_lens, seq_lens = SHAPES["decode"]
    batch = make_batch(q_lens, seq_lens, 8, 2, 32, 4, torch.float32)
    out = torch.empty_like(batch["query"])
    args = [batch[k] for k in ("query", "key_cache", "value_cache")] + [out]
    args += [batch["query_start_loc"], batch["seq_lens"], batch["block_table"][:-1], 0.2]
    with pytest.raises(ValueError, match="seq_order"):
        paged_attention(*args, backend="triton", seq_order=torch.arange(3, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype):
    q_lens, seq_lens = SHAPES["mixed"]
    batch = make_batch(q_lens, seq_lens, 8, 2, 24, 16, dtype, seed=7)  # head 24: padded dims
    ref = run_attention(batch, 0.2, None, "torch")
    assert ref.dtype == dtype
    for kw in ({}, dict(num_splits=3)):
        out = run_attention(batch, 0.2, None, "triton", **kw)
        assert_written_and_untouched(out, batch["num_tokens"])
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_reference(dtype, layout):
    g = torch.Generator().manual_seed(3)
    num_tokens, hkv, d, bs, num_blocks = 13, 3, 24, 4, 9
    key = torch.randn(num_tokens, hkv, d, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, hkv, d, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * bs, generator=g)[:num_tokens]
    slots[[0, 5, 12]] = -1
    # Entries past the first T are never read (here they would write out of bounds).
    slot_mapping = torch.cat([slots, torch.full((4,), 10**6)]).to(DEVICE)
    caches = {}
    for backend in ("torch", "triton"):
        memory = torch.full((2 * num_blocks * bs * hkv * d,), -7.0, dtype=dtype, device=DEVICE)
        kv = paged_kv_view(memory, num_blocks, bs, hkv, d, layout)
        reshape_and_cache(key, value, kv[0], kv[1], slot_mapping, backend=backend)
        caches[backend] = kv.cpu()
    assert torch.equal(caches["torch"], caches["triton"])
    flat = caches["triton"].flatten(1, 2)  # [2, slots, Hkv, D]
    kept = slots >= 0
    assert torch.equal(flat[0, slots[kept]], key.cpu()[kept])
    assert torch.equal(flat[1, slots[kept]], value.cpu()[kept])
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert (flat[:, untouched] == -7.0).all()


def test_num_splits_heuristic():
    # Few long decodes split; a full grid, a short context, or a prefill never does.
    assert choose_num_splits(1, 8, 1, 16384, 132) > 1
    assert choose_num_splits(8, 8, 1, 4096, 132) > 1
    assert choose_num_splits(32, 8, 1, 4096, 132) == 1
    assert choose_num_splits(1, 8, 1, 300, 132) > 1
    assert choose_num_splits(1, 8, 1, 100, 132) == 1
    assert choose_num_splits(1, 8, 64, 16384, 132) == 1
    # powers of two only (3 and 5 ran slower than 2 and 4 on the H200)
    assert [choose_num_splits(b, 8, 1, 40960, 132) for b in (1, 2, 4, 8, 16)] == [32, 16, 8, 4, 2]


def test_bad_input_errors_name_the_field():
    batch = make_batch([1], [5], 4, 2, 16, 4, torch.float32)
    base = dict(
        query=batch["query"],
        key_cache=batch["key_cache"],
        value_cache=batch["value_cache"],
        out=torch.empty_like(batch["query"]),
        query_start_loc=batch["query_start_loc"],
        seq_lens=batch["seq_lens"],
        block_table=batch["block_table"],
        scale=0.25,
    )
    bad = {
        "num_heads": dict(query=batch["query"][:, :3], out=batch["query"][:, :3].clone()),
        "query_start_loc": dict(query_start_loc=batch["query_start_loc"][:1]),
        "block_table": dict(block_table=batch["block_table"].float()),
        "sliding_window": dict(sliding_window=0),
        "backend": dict(backend="cuda"),
        "query dtype": dict(query=batch["query"].half(), out=batch["query"].half()),
    }
    for field, change in bad.items():
        with pytest.raises(ValueError, match=field):
            paged_attention(**{**base, **change})
    kv = batch["key_cache"]
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(kv[0, :2], kv[0, :2], kv, kv, torch.zeros(1, dtype=torch.int64))


def test_tiles_too_big_for_shared_memory_fall_back_to_smaller_ones(monkeypatch):
    """A device that cannot hold the first tile choice (head 256 in fp32 on the H200) gets smaller
    KV tiles and fewer stages, with the same rows, and the result still equals the reference."""
    import triton

    from kvcore.kernels import paged_attention as pa
    from kvcore.kernels.attention_tiles import large_tiles, shrink, small_tiles

    t = small_tiles(2)
    chain = [t]
    while (t := shrink(t, t.block_m)) is not None:
        chain.append(t)
    assert [(x.block_n, x.num_stages) for x in chain] == [(128, 3), (64, 3), (32, 3), (16, 3), (16, 2), (16, 1)]
    assert {x.block_m for x in chain} == {16}
    big = large_tiles(2, 256)
    while (smaller := shrink(big, 16)) is not None:
        big = smaller
    assert (big.block_m, big.block_n, big.num_stages) == (16, 16, 1)

    launched, real = [], pa.launch_tiles

    def limited(a, tiles, *rest):
        launched.append(tiles)
        if tiles.block_n > 32 or tiles.num_stages > 2:  # a device with less shared memory
            raise triton.runtime.errors.OutOfResources(287296, 232448, "shared memory")
        return real(a, tiles, *rest)

    monkeypatch.setattr(pa, "launch_tiles", limited)
    monkeypatch.setattr(pa, "FITTED_TILES", {})
    batch = make_batch(*SHAPES["mixed"], 4, 2, 32, 8, torch.float32, seed=11)
    ref = run_attention(batch, 0.2, None, "torch")
    out = run_attention(batch, 0.2, None, "triton")
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32], equal_nan=True)
    assert all(x.block_n <= 32 and x.num_stages <= 2 for x in pa.FITTED_TILES.values()) and pa.FITTED_TILES
    tried = len(launched)
    run_attention(batch, 0.2, None, "triton")  # remembered: no failed try the second time
    assert all(x.block_n <= 32 and x.num_stages <= 2 for x in launched[tried:])


def test_one_failed_compile_jumps_to_tiles_that_fit():
    """The compiler's figures for one variant calibrate the shared-memory model: the next try is the
    first variant along the shrink chain that the model says fits, not the next one."""
    from kvcore.kernels.attention_tiles import fit, large_tiles, shrink, smem_model

    big = large_tiles(2, 256)  # head 256 in fp32 on the H200: 287,296 bytes needed, 232,448 there
    got = fit(big, 16, 256, 287296, 232448)
    assert got is not None and 287296 * smem_model(got, 256) <= 232448 * smem_model(big, 256)
    prev = shrink(big, 16)
    assert prev is not None and (prev == got or 287296 * smem_model(prev, 256) > 232448 * smem_model(big, 256))
    assert (got.block_m, got.block_n, got.num_stages) == (64, 32, 3)
    end = big
    while (nxt := shrink(end, 16)) is not None:
        end = nxt
    assert fit(big, 16, 256, 10**9, 1) == end  # nothing fits by the model: the smallest, for the compiler
    assert fit(end, 16, 256, 10**9, 1) is None  # nothing smaller is left: the caller raises


def test_head_256_in_float32_starts_from_the_tiles_measured_to_compile():
    """On the H200 the usual tiles for head 256 in fp32 compiled for over 40 s and then did not fit
    shared memory; 16x32 / 32x16 in 2 stages compiled in ~5 s. Half precision keeps its tiles."""
    from kvcore.kernels.attention_tiles import large_tiles, small_tiles

    assert (small_tiles(2, 256, 4).block_n, small_tiles(2, 256, 4).num_stages) == (32, 2)
    assert (large_tiles(2, 256, 4).block_m, large_tiles(2, 256, 4).block_n) == (32, 16)
    assert small_tiles(2, 256, 2) == small_tiles(2) and large_tiles(2, 256, 2).block_m == 64
    assert small_tiles(8, 128, 4).block_n == 128  # head 128 in fp32: 512-byte rows, the usual tiles


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_head_256_float32(kind):
    """Gemma's head size in float32: on the H200 the first tile choice does not fit shared memory."""
    batch = make_batch(*SHAPES[kind], 4, 2, 256, 16, torch.float32, seed=13)
    ref = run_attention(batch, 0.0625, None, "torch")
    out = run_attention(batch, 0.0625, None, "triton")
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32], equal_nan=True)


def test_kv_layout_switch_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("KVRAY_KV_LAYOUT", "hnd")
    assert kv_layout() == "HND"
    monkeypatch.setenv("KVRAY_KV_LAYOUT", "NDH")
    with pytest.raises(ValueError, match=r"KVRAY_KV_LAYOUT='NDH': must be one of NHD, HND"):
        kv_layout()
    with pytest.raises(ValueError, match=r"layout 'HDN'"):
        paged_kv_view(torch.empty(2 * 4 * 2 * 8), 1, 4, 2, 8, "HDN")
