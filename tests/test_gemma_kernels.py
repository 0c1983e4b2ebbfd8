"""Gemma's (1 + w) RMSNorm in the Triton RMSNorm and q/k-norm + rotary kernels (TRITON_INTERPRET=1)
against the torch references, and the references against the GemmaRMSNorm layer (HF's formula)."""

import pytest
import torch

from actors.layers.kernels import layer_ops
from actors.layers.norm import GemmaRMSNorm
from actors.layers.rotary import RopeParams, RotaryEmbedding


def _gemma_layer(n, dtype, w):
    layer = GemmaRMSNorm(n, 1e-6, dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_kernel_matches_reference_and_layer(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    w = (torch.randn(96, generator=g) * 0.3).to(dtype)
    ref = layer_ops.rms_norm(x, w, 1e-6, backend="torch", gemma=True)
    assert torch.equal(ref, _gemma_layer(96, dtype, w)(x))
    out = layer_ops.rms_norm(x, w, 1e-6, backend="triton", gemma=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)
    llama = layer_ops.rms_norm(x, w, 1e-6, backend="torch")
    assert not torch.allclose(llama.float(), ref.float()), "gemma=True must change the scale"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_qk_norm_rope_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 6, 4, 2, 16
    q = torch.randn(t, hq * d, generator=g).to(dtype)
    k = torch.randn(t, hkv * d, generator=g).to(dtype)
    qw, kw = (torch.randn(d, generator=g) * 0.3).to(dtype), (torch.randn(d, generator=g) * 0.3).to(dtype)
    pos = torch.tensor([0, 3, 7, 8, 20, 31])
    rope = RotaryEmbedding(d, 64, RopeParams(theta=100.0))
    ref_q, ref_k = layer_ops.qk_norm_rope(q, k, pos, rope.cos_sin_cache, qw, kw, 1e-6, backend="torch", gemma=True)
    # The reference's norm is the layer's: rotary of GemmaRMSNorm(q) per head.
    nq = _gemma_layer(d, dtype, qw)(q.view(t, hq, d)).view(t, -1)
    exp_q, _ = rope(pos, nq, k)
    assert torch.equal(ref_q, exp_q)
    out_q, out_k = layer_ops.qk_norm_rope(q, k, pos, rope.cos_sin_cache, qw, kw, 1e-6, backend="triton", gemma=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out_q, ref_q, **tol)
    torch.testing.assert_close(out_k, ref_k, **tol)
