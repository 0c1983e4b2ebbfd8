"""The fused-MoE Triton kernel (under TRITON_INTERPRET=1) against HF's expert loop in torch, and
the expert alignment it relies on."""

import pytest
import torch

from actors.layers.fused_moe import route_topk
from actors.layers.kernels.fused_moe import align_by_expert, fused_moe_triton
from actors.layers.kernels.moe_reference import fused_moe_ref


def make(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=0, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9  # an expert no token picks
    weights, ids = route_topk(logits, top_k, normalize=True, weight_dtype=dtype)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_groups_pairs_by_expert_in_padded_tiles(block_m):
    ids = torch.tensor([[3, 0], [0, 1], [3, 0], [2, 3], [0, 3]])
    sorted_ids, expert_ids = align_by_expert(ids, 5, block_m)
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(expert_ids.tolist()):
        tile = sorted_ids[b * block_m : (b + 1) * block_m].tolist()
        real = [p for p in tile if p < flat.numel()]
        if e < 0:
            assert not real, f"tile {b} has no expert but holds pairs {real}"
            continue
        assert real and all(flat[p] == e for p in real), f"tile {b} of expert {e} holds {real}"
        seen += real
    assert sorted(seen) == list(range(flat.numel()))
    assert 4 not in expert_ids.tolist()  # expert 4 has no pairs: no tile


@pytest.mark.parametrize("shape", [(7, 4, 2, 32, 16), (1, 8, 2, 32, 48), (40, 6, 3, 48, 24)])
def test_fused_moe_matches_expert_loop_fp32(shape):
    x, w13, w2, weights, ids = make(*shape, torch.float32, seed=shape[0], skip_expert=1)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    for kw in ({}, dict(block_m=16, block_n=16, block_k=16)):
        out = fused_moe_triton(x, w13, w2, weights, ids, **kw)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_fused_moe_bf16_and_float32_routing_weights():
    x, w13, w2, weights, ids = make(9, 4, 2, 32, 16, torch.bfloat16, seed=5)
    for w in (weights, weights.float()):
        ref = fused_moe_ref(x, w13, w2, w, ids)
        out = fused_moe_triton(x, w13, w2, w, ids, block_m=16, block_n=16, block_k=16)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_route_topk_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route_topk(logits, 2, normalize=False, weight_dtype=torch.float32)
    assert ids.tolist() == [[0, 1]] and w.sum() < 1
    w, _ = route_topk(logits, 2, normalize=True, weight_dtype=torch.float32)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))
