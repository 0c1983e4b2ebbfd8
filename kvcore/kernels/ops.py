"""Attention-op dispatchers used by the attention layer: "torch" runs the plain-torch references
(CPU backend, oracle), "triton" the GPU kernels (also runnable under TRITON_INTERPRET=1).

Validation reads only shapes, dtypes, strides and devices, never tensor values, so it costs no
device synchronisation on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.kernels import check_backend as _check_backend
from kvcore.kernels import require as _require
from kvcore.kernels.fp8 import FORMATS as FP8_FORMATS
from kvcore.kernels.reference import paged_attention_ref, reshape_and_cache_ref

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*FLOAT_DTYPES, *FP8_FORMATS)


@dataclass(frozen=True)
class KVCacheWrite:
    """Where one attention layer's K/V of this step go: its paged caches [num_blocks, block_size, Hkv, D],
    the step's slots (slot -1: not written) and the fp8 scales (1.0 for a float cache)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


def _check_scales(k_scale: float, v_scale: float) -> None:
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _require(
            isinstance(s, (int, float)) and 0 < s < float("inf"),
            f"{name} must be a positive finite number, got {s!r}",
        )


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require(
        key_cache.dim() == 4,
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got shape {tuple(key_cache.shape)}",
    )
    _require(
        value_cache.shape == key_cache.shape,
        f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape {tuple(key_cache.shape)}",
    )
    _require(
        key_cache.dtype == value_cache.dtype,
        f"value_cache dtype {value_cache.dtype} must equal key_cache dtype {key_cache.dtype}",
    )
    _require(
        key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1,
        "key_cache/value_cache: head_size dimension must be contiguous (stride 1)",
    )
    _require(key_cache.dtype in CACHE_DTYPES, f"key_cache dtype must be one of {CACHE_DTYPES}, got {key_cache.dtype}")


def check_cache_write(key: torch.Tensor, value: torch.Tensor, cache: KVCacheWrite) -> None:
    """The rules of writing key/value [T, Hkv, D] into `cache` (shapes, dtypes, devices; no values read)."""
    key_cache, slot_mapping = cache.key_cache, cache.slot_mapping
    _check_cache_pair(cache.key_cache, cache.value_cache)
    _check_scales(cache.k_scale, cache.v_scale)
    _require(key.dim() == 3, f"key must be [T, num_kv_heads, head_size], got {tuple(key.shape)}")
    _require(value.shape == key.shape, f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    _require(
        tuple(key.shape[1:]) == tuple(key_cache.shape[2:]),
        f"key [T, Hkv, D] = {tuple(key.shape)} does not match key_cache [.., .., Hkv, D] = {tuple(key_cache.shape)}",
    )
    _require(
        key.dtype in FLOAT_DTYPES and value.dtype in FLOAT_DTYPES,
        f"key/value dtype must be one of {FLOAT_DTYPES}, got {key.dtype}/{value.dtype}",
    )
    _require(
        slot_mapping.dim() == 1 and slot_mapping.dtype in INDEX_DTYPES,
        f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} shape {tuple(slot_mapping.shape)}",
    )
    _require(
        slot_mapping.shape[0] >= key.shape[0],
        f"slot_mapping has {slot_mapping.shape[0]} entries, fewer than the {key.shape[0]} tokens of key",
    )
    devices = {t.device for t in (key, value, cache.key_cache, cache.value_cache, cache.slot_mapping)}
    _require(len(devices) == 1, f"all tensors must be on one device, got {devices}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "torch",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at
    slot_mapping[:T] (slot = block * block_size + offset); slot -1 writes nothing. An fp8 cache
    stores key / k_scale and value / v_scale (saturated, nearest even)."""
    _check_backend(backend)
    check_cache_write(key, value, KVCacheWrite(key_cache, value_cache, slot_mapping, k_scale, v_scale))
    if backend == "torch":
        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    _require(
        key.stride(-1) == 1 and value.stride(-1) == 1, "key/value: head_size dimension must be contiguous (stride 1)"
    )
    from kvcore.kernels.cache_write import reshape_and_cache_triton

    reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    sliding_window: int | None,
) -> None:
    _check_cache_pair(key_cache, value_cache)
    _require(query.dim() == 3, f"query must be [T, num_heads, head_size], got shape {tuple(query.shape)}")
    _require(out.shape == query.shape, f"out shape {tuple(out.shape)} must equal query shape {tuple(query.shape)}")
    _require(
        query.dtype == key_cache.dtype or key_cache.dtype in FP8_FORMATS,
        f"query dtype {query.dtype} must equal key_cache dtype {key_cache.dtype} (or the cache be fp8)",
    )
    _require(
        query.dtype in FLOAT_DTYPES and out.dtype in FLOAT_DTYPES,
        f"query/out dtype must be one of {FLOAT_DTYPES}, got {query.dtype}/{out.dtype}",
    )
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    _require(
        head_size == key_cache.shape[3], f"query head_size {head_size} != key_cache head_size {key_cache.shape[3]}"
    )
    _require(
        num_heads % num_kv_heads == 0, f"query num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
    )
    _require(
        query.stride(-1) == 1 and out.stride(-1) == 1, "query/out: head_size dimension must be contiguous (stride 1)"
    )
    _require(
        seq_lens.dim() == 1 and seq_lens.dtype in INDEX_DTYPES,
        f"seq_lens must be 1-D int32, got {seq_lens.dtype} shape {tuple(seq_lens.shape)}",
    )
    num_seqs = seq_lens.shape[0]
    _require(
        query_start_loc.dim() == 1
        and query_start_loc.dtype in INDEX_DTYPES
        and query_start_loc.shape[0] == num_seqs + 1,
        f"query_start_loc must be 1-D int32 of length len(seq_lens)+1 = {num_seqs + 1}, "
        f"got {query_start_loc.dtype} shape {tuple(query_start_loc.shape)}",
    )
    _require(
        block_table.dim() == 2 and block_table.dtype in INDEX_DTYPES and block_table.shape[0] >= num_seqs,
        f"block_table must be 2-D int32 with >= {num_seqs} rows, got {block_table.dtype} "
        f"shape {tuple(block_table.shape)}",
    )
    _require(block_table.stride(-1) == 1, "block_table: rows must be contiguous (stride 1)")
    _require(
        sliding_window is None or (isinstance(sliding_window, int) and sliding_window > 0),
        f"sliding_window must be None or a positive int, got {sliding_window!r}",
    )
    tensors = (query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table)
    devices = {t.device for t in tensors}
    _require(len(devices) == 1, f"all tensors must be on one device, got {devices}")


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    backend: str = "torch",
    softcap: float | None = None,
    seq_order: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal GQA attention of a mixed batch over the paged cache (see the team contract).

    Sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1] and sit at the LAST
    q_len positions of its seq_len tokens. max_query_len / max_seq_len are host ints that size the
    Triton grid without a device sync; max_query_len must be >= every sequence's q_len (a smaller
    value leaves rows unwritten), max_seq_len only steers the split-KV heuristic. When omitted they
    are read from the device (a sync). `softcap` (Gemma-2) caps each scaled score at
    softcap * tanh(score / softcap) before the mask and softmax. `seq_order` (int32 [num_seqs], a
    permutation, e.g. `longest_first(seq_lens)`) only orders the Triton launch's programs: the
    result is the same with or without it. An fp8 cache's entries count as stored * k_scale (keys)
    and stored * v_scale (values)."""
    _check_backend(backend)
    _check_scales(k_scale, v_scale)
    _require(
        softcap is None or (isinstance(softcap, (int, float)) and softcap > 0),
        f"softcap must be None or a positive number, got {softcap!r}",
    )
    _check_attention_args(query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, sliding_window)
    _require(
        seq_order is None
        or (seq_order.dtype == torch.int32 and seq_order.shape == seq_lens.shape and seq_order.device == query.device),
        "seq_order must be None or an int32 permutation shaped like seq_lens, on the query's device",
    )
    args = (query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table, scale)
    if backend == "torch":
        paged_attention_ref(*args, sliding_window, softcap, (k_scale, v_scale))
        return
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if seq_lens.shape[0] else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.shape[0] else 0
    _require(
        isinstance(max_query_len, int) and max_query_len >= 0,
        f"max_query_len must be a non-negative int, got {max_query_len!r}",
    )
    if max_query_len == 0:
        return
    from kvcore.kernels.paged_attention import paged_attention_triton

    paged_attention_triton(
        *args,
        sliding_window,
        max_query_len,
        max_seq_len,
        softcap=softcap,
        seq_order=seq_order,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The sequences by descending context length (ties in index order), int32, on seq_lens' device
    and without a host sync, so a CUDA graph can capture it: paged_attention's seq_order."""
    return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
