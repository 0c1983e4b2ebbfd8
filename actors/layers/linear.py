"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features across ranks and need no communication; a
row-parallel layer splits the input features, so each rank holds a partial sum that one all-reduce
completes. Pairing them (QKV/gate-up column, O/down row) costs one all-reduce per block.
Every weight_loader takes the FULL checkpoint tensor (or a lazy safetensors slice of it) and copies
only this rank's shard, checking the full shape first so a wrong checkpoint fails by name.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from actors import parallel_state as ps
from actors.layers.fp8_linear import fp8_linear, fp8_shape_ok, quantize_weight_fp8
from actors.layers.kernels.small_m_gemm import small_m_linear, small_m_silu_mul
from actors.layers.kernels.small_m_tuned import tuned_config
from actors.layers.weight_utils import check_full_shape, copy_into, narrow, new_param, read_all


class _LinearBase(nn.Module):
    """The weight's two forms: the model dtype as loaded, or fp8 after quantize_fp8 (then `weight` is None
    and the e4m3 weight and its per-channel scales are buffers)."""

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor

    def quantize_fp8(self) -> bool:
        """Swap the loaded weight for its fp8 form; False (nothing changes) where the GEMM's shape rule fails."""
        w = self.weight
        if w is None or not fp8_shape_ok(w):
            return False
        wq, scale = quantize_weight_fp8(w.data)
        self.out_dtype = w.dtype
        self.register_parameter("weight", None)
        self.register_buffer("weight_fp8", wq)
        self.register_buffer("weight_scale", scale)
        return True

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.weight
        if w is None:
            return fp8_linear(x, self.weight_fp8, self.weight_scale, bias, self.out_dtype)
        if x.is_cuda:  # a decode step's few rows: the Triton kernel where it measured faster on this GPU
            x2 = x.reshape(-1, x.shape[-1])
            config = tuned_config(x2.shape[0], w)
            if config is not None and x2.stride(-1) == 1 and w.stride(-1) == 1:
                y = small_m_linear(x2, w, bias, x.dtype, config=config)
                return y.reshape(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, bias)


# Rows up to which a gate/up GEMM takes its activation in its epilogue (small_m_silu_mul); 0 turns it off.
FUSED_GATE_UP_MAX_M = int(os.environ.get("KVRAY_FUSED_GATE_UP_MAX_M", "16"))


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts != 0:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


class ColumnParallelLinear(_LinearBase):
    """y = x W^T + b with W's output rows split evenly across ranks; output stays sharded."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype, name: str = "output_size"
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, name)
        self.weight = new_param((self.output_size_per_partition, input_size), params_dtype, self.weight_loader)
        self.bias = new_param((self.output_size_per_partition,), params_dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        full = (self.output_size,) + tuple(param.shape[1:])
        check_full_shape(loaded, full)
        n = self.output_size_per_partition
        copy_into(param, narrow(loaded, 0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one (gate and up): each rank holds its shard of
    every sub-matrix, concatenated, so one GEMM computes all of them."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, params_dtype: torch.dtype) -> None:
        tp = ps.tp_size()
        for i, size in enumerate(output_sizes):
            _divide(size, tp, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, params_dtype)
        # Two halves of one size (gate and up) in a 16-bit dtype with no bias: what small_m_silu_mul takes
        # (float32 tiles of its size would not fit the kernel's shared memory).
        self._gated_epilogue = (
            FUSED_GATE_UP_MAX_M > 0
            and len(output_sizes) == 2
            and output_sizes[0] == output_sizes[1]
            and not bias
            and params_dtype in (torch.bfloat16, torch.float16)
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for [gate | up] in the GEMM's own launch, for a decode step's few rows on the GPU:
        no activation launch, and the [M, 2N] output is never written. None where it does not apply (the
        caller then runs the GEMM and SiluAndMul): fp8 or float32 weights, a bias, more than FUSED_GATE_UP_MAX_M
        rows."""
        w = self.weight
        if not self._gated_epilogue or w is None or w.dtype != x.dtype or not x.is_cuda:
            return None  # no weight: quantized to fp8 (quantize_fp8)
        x2 = x.reshape(-1, x.shape[-1])
        if not 0 < x2.shape[0] <= FUSED_GATE_UP_MAX_M or x2.stride(-1) != 1:
            return None
        return small_m_silu_mul(x2, w).reshape(*x.shape[:-1], w.shape[0] // 2)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id={shard_id!r}: must be an index into {len(self.output_sizes)} merged matrices")
        size = self.output_sizes[shard_id]
        check_full_shape(loaded, (size,) + tuple(param.shape[1:]))
        n = size // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        copy_into(param.narrow(0, offset, n), narrow(loaded, 0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections as one column-parallel GEMM, split by heads.

    When tp > num_kv_heads each KV head is replicated on tp // num_kv_heads consecutive ranks
    (rank r holds KV head r // replicas), the same mapping vLLM uses, so the query heads of a rank
    always find their KV head locally.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        tp = ps.tp_size()
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        if tp >= total_num_kv_heads:
            if tp % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp} must be a multiple of "
                    f"num_key_value_heads={total_num_kv_heads} when it exceeds it"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        # The layer's global output size counts replicated KV heads once per rank.
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, out, bias, params_dtype)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        d = self.head_size
        if shard_id == "q":
            total, local, src_rank, offset = self.total_num_heads, self.num_heads, self.tp_rank, 0
        elif shard_id in ("k", "v"):
            total, local = self.total_num_kv_heads, self.num_kv_heads
            src_rank = self.tp_rank // self.num_kv_head_replicas
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        else:
            raise ValueError(f"shard_id={shard_id!r}: must be 'q', 'k' or 'v'")
        check_full_shape(loaded, (total * d,) + tuple(param.shape[1:]))
        n = local * d
        copy_into(param.narrow(0, offset, n), narrow(loaded, 0, src_rank * n, n))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_LinearBase):
    """y = x W^T + b with W's input columns split across ranks; x arrives sharded (from a
    column-parallel layer), the partial products are summed by one all-reduce, then the bias is
    added once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        params_dtype: torch.dtype,
        reduce_results: bool = True,
        name: str = "input_size",
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size, name)
        self.reduce_results = reduce_results
        self.weight = new_param((output_size, self.input_size_per_partition), params_dtype, self.weight_loader)
        self.bias = new_param((output_size,), params_dtype, self.weight_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias: replicated
            check_full_shape(loaded, (self.output_size,))
            copy_into(param, read_all(loaded))
            return
        check_full_shape(loaded, (self.output_size, self.input_size))
        n = self.input_size_per_partition
        copy_into(param, narrow(loaded, 1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.reduce_results:
            y = ps.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
