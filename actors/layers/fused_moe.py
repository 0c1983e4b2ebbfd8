"""Mixture-of-experts layers: the top-k router and the experts with tensor-parallel sharding.

Each rank holds every expert, sliced along the intermediate dimension (gate/up rows, down columns),
so the experts' down projections give partial sums that one all-reduce completes, exactly like a
dense MLP's row-parallel down projection. Weights are stacked per layer: w13 [E, 2*I/tp, H] (this
rank's gate rows then its up rows) and w2 [E, H, I/tp], the layout the fused kernel reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from actors import parallel_state as ps
from actors.layers.weight_utils import check_full_shape, copy_into, default_weight_loader, narrow, new_param


def route_topk(
    router_logits: torch.Tensor, top_k: int, normalize: bool, weight_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router: softmax in float32, top-k, renormalised when `normalize`, weights cast to
    `weight_dtype` (Qwen3-MoE: the model dtype; Mixtral keeps float32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        backend: str = "torch",
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"moe_intermediate_size={intermediate_size} is not divisible by tensor_parallel_size={self.tp_size}"
            )
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.shard = intermediate_size // self.tp_size
        self.backend = backend
        self.w13_weight = new_param((num_experts, 2 * self.shard, hidden_size), params_dtype, self.weight_loader)
        self.w2_weight = new_param((num_experts, hidden_size, self.shard), params_dtype, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        """shard_id = (expert, "gate" | "up" | "down"); `loaded` is that expert's full HF tensor."""
        expert, kind = shard_id
        n = self.shard
        if kind == "down":
            check_full_shape(loaded, (self.hidden_size, self.intermediate_size))
            copy_into(param[expert], narrow(loaded, 1, self.tp_rank * n, n))
            return
        check_full_shape(loaded, (self.intermediate_size, self.hidden_size))
        offset = 0 if kind == "gate" else n
        copy_into(param[expert].narrow(0, offset, n), narrow(loaded, 0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from actors.layers.kernels.fused_moe import fused_moe_triton

            out = fused_moe_triton(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            from actors.layers.kernels.moe_reference import fused_moe_ref

            out = fused_moe_ref(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return ps.all_reduce(out)


class _Router(nn.Module):
    """The router's [num_experts, hidden] weight as a module of its own, so it loads as `gate.weight`."""

    def __init__(self, num_experts: int, hidden_size: int, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((num_experts, hidden_size), params_dtype, default_weight_loader)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) + experts: the MLP of a sparse layer."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        normalize: bool,
        float32_weights: bool,
        params_dtype: torch.dtype,
        backend: str,
    ) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.weight_dtype = torch.float32 if float32_weights else params_dtype
        self.gate = _Router(num_experts, hidden_size, params_dtype)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, params_dtype, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(F.linear(x, self.gate.weight), self.top_k, self.normalize, self.weight_dtype)
        return self.experts(x, weights, ids)
