"""fp8 weights (model.quantization="fp8"): the Triton per-token quantizer against its torch reference bit for
bit (under TRITON_INTERPRET=1), the per-channel weight quantization, the scaled GEMM against the dequantized
product, and the linear layers' swap. End to end, vLLM's logprobs rule: tests/test_check_logprobs_close.py.
"""

import os

import pytest
import torch

from actors.layers.fp8_linear import (
    fp8_linear,
    per_token_quant_fp8_ref,
    quantize_weight_fp8,
)
from actors.layers.kernels.fp8_quant import per_token_quant_fp8_triton
from actors.layers.kernels.fp8_scale import FMAX, MIN_SCALE
from actors.layers.kernels.small_m_gemm import (
    GemmConfig,
    default_config,
    w8a16_linear,
    w8a16_linear_ref,
)

E4M3 = torch.float8_e4m3fn
# The quantizer tests run the compiled kernel on a GPU with TRITON_INTERPRET=0 (python -m benchmarks fp8).
DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] != "1" and torch.cuda.is_available() else "cpu"


def activations(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, an all-zero row (a graph's padding row), a row with one outlier
    (most of it quantizes to subnormals or zero), and exact ties of the fp8 grid."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[1] = 0.0
    x[2, 5] = 1e4
    x[3, : min(cols, 8)] = torch.tensor([448.0, 416.0, 432.0, 440.0, -424.0, 1.0, 0.5, -0.0])[: min(cols, 8)]
    return x


@pytest.mark.parametrize("cols", [40, 1024, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantizer_matches_the_reference_bit_for_bit(dtype, cols):
    x = activations(7, cols).to(dtype).to(DEVICE)
    q_ref, s_ref = per_token_quant_fp8_ref(x)
    q, s = per_token_quant_fp8_triton(x)
    assert q.dtype == E4M3 and s.shape == (7, 1) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s[1].item() == torch.tensor(MIN_SCALE).item()  # the zero row divides by the floor (in fp32): stays 0
    assert (q[1].float() == 0).all()


def test_triton_quantizer_reads_strided_rows():
    """A view into a wider buffer (say q out of a fused QKV output): rows strided, columns unit-stride."""
    wide = activations(5, 96, seed=3).to(DEVICE)
    x = wide[:, 16:80]
    q, s = per_token_quant_fp8_triton(x)
    q_ref, s_ref = per_token_quant_fp8_ref(x.contiguous())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_every_row_uses_the_whole_range():
    x = activations(6, 256, seed=1)
    q, s = per_token_quant_fp8_ref(x)
    assert torch.equal(q.float().abs().amax(-1)[[0, 2, 3, 4, 5]], torch.full((5,), FMAX))
    back = q.float() * s
    err = (back - x).abs().amax(-1) / x.abs().amax(-1).clamp(min=1e-30)
    assert (err[[0, 2, 3, 4, 5]] <= 2.0**-4).all()  # half a step of 3 mantissa bits, relative to the row's max


def test_weights_quantize_per_output_channel():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 32, generator=g) * torch.linspace(0.01, 10, 48)[:, None]
    wq, scale = quantize_weight_fp8(w)
    assert wq.shape == (48, 32) and wq.dtype == E4M3 and wq.is_contiguous()
    assert scale.shape == (1, 48) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[0], w.abs().amax(-1) / FMAX)
    rel = ((wq.float() * scale.t()) - w).abs().amax(-1) / w.abs().amax(-1)
    assert (rel <= 2.0**-4).all()


@pytest.mark.parametrize("bias", [False, True])
def test_scaled_gemm_is_the_product_of_the_dequantized_operands(bias):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 64, generator=g), torch.randn(32, 64, generator=g) / 8
    b = torch.randn(32, generator=g) if bias else None
    wq, ws = quantize_weight_fp8(w)
    y = fp8_linear(x.view(3, 3, 64), wq, ws, b, torch.float32, small_m_max=0)  # the scaled GEMM at any M
    assert y.shape == (3, 3, 32)
    xq, xs = per_token_quant_fp8_ref(x)
    exact = (xq.float() * xs) @ (wq.float() * ws.t()).t() + (0 if b is None else b)
    torch.testing.assert_close(y.reshape(9, 32), exact, atol=1e-5, rtol=1e-5)
    full = torch.nn.functional.linear(x, w, b)
    assert (y.reshape(9, 32) - full).abs().max() < 0.1 * full.abs().max()  # fp8's error, not garbage


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 64, 256, GemmConfig()),  # one row: the MMA's short side padded to 16
        (20, 96, 512, GemmConfig(block_k=128, split_k=2)),  # N not a multiple of the tile, K split in two
        (5, 64, 304, GemmConfig(block_k=128, split_k=2)),  # K not a multiple of the tile: the masked loads
        (40, 128, 768, GemmConfig(block_k=128, split_k=3)),  # three splits; 64 rows of the MMA's short side
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_small_m_kernel_matches_its_reference(m, n, k, cfg, bias):
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=g) / k**0.5
    wq, ws = quantize_weight_fp8(w)
    x = activations(max(m, 4), k, seed=m)[:m].clamp(-1e5, 1e5).to(torch.bfloat16)
    x[0, 1] = 1e5  # past fp16's range: saturated, not inf
    b = torch.randn(n, generator=g) if bias else None
    wq, ws, x = wq.to(DEVICE), ws.to(DEVICE), x.to(DEVICE)
    b = b.to(DEVICE) if b is not None else None
    y = w8a16_linear(x, wq, ws, b, torch.float32, cfg)
    ref = w8a16_linear_ref(x, wq, ws, b, torch.float32)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-4)
    out = w8a16_linear(x, wq, ws, b, torch.bfloat16, cfg)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_small_m_kernel_reads_strided_rows_and_zero_rows():
    w = torch.randn(64, 256) / 16
    wq, ws = quantize_weight_fp8(w)
    wide = torch.randn(4, 320).to(torch.bfloat16)
    x = wide[:, 32:288]  # rows strided, columns unit-stride
    torch.testing.assert_close(
        w8a16_linear(x, wq, ws, None, torch.float32), w8a16_linear_ref(x, wq, ws, None, torch.float32)
    )
    assert w8a16_linear(x[:0], wq, ws, None, torch.float32).shape == (0, 64)


def test_default_config_splits_k_until_the_grid_fills_the_sms():
    assert default_config(16, 28672, 4096, 132).split_k == 1  # Llama's gate_up: 448 tiles already
    assert default_config(16, 4096, 14336, 132).split_k == 4  # Llama's down: 64 tiles, 56 K tiles
    assert default_config(16, 6144, 4096, 132).split_k == 2  # Llama's qkv: 96 tiles
    assert default_config(16, 4096, 4096, 132).split_k == 4  # o: 64 tiles x 4 splits = 256 programs
    assert default_config(64, 1024, 2048, 132).split_k == 8  # Qwen3-0.6B's o: 16 tiles, capped at 8


@pytest.mark.parametrize("m", [3, 16])
def test_fp8_linear_dispatches_small_m_to_the_kernel(m):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(m, 64, generator=g), torch.randn(32, 64, generator=g) / 8
    wq, ws = quantize_weight_fp8(w)
    small = fp8_linear(x, wq, ws, None, torch.float32, small_m_max=16)
    torch.testing.assert_close(small, w8a16_linear_ref(x, wq, ws, None, torch.float32))
    scaled = fp8_linear(x, wq, ws, None, torch.float32, small_m_max=m - 1)
    assert not torch.equal(small, scaled)  # the scaled GEMM rounds the activations to fp8 too
    full = torch.nn.functional.linear(x, w)
    assert (small - full).norm() < (scaled - full).norm() < 0.1 * full.norm()  # one operand rounded, not two


def test_linear_layers_swap_their_weight_and_keep_their_output():
    from actors.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    torch.manual_seed(5)
    col = MergedColumnParallelLinear(64, [32, 32], True, torch.float32)
    row = RowParallelLinear(64, 48, True, torch.float32)
    odd = RowParallelLinear(40, 24, False, torch.float32)  # 24 x 40: not multiples of 16
    for layer in (col, row, odd):
        for p in layer.parameters():
            p.data.normal_(0, 0.2)
    x = torch.randn(5, 64)
    before = (col(x), row(x), odd(x[:, :40]))
    assert col.quantize_fp8() and row.quantize_fp8() and not odd.quantize_fp8()
    assert col.weight is None and col.weight_fp8.dtype == E4M3 and col.bias is not None
    assert odd.weight is not None  # untouched: the GPU's scaled GEMM needs multiples of 16
    after = (col(x), row(x), odd(x[:, :40]))
    for b, a in zip(before[:2], after[:2], strict=True):
        assert not torch.equal(a, b) and (a - b).abs().max() < 0.1 * b.abs().max()
    assert torch.equal(before[2], after[2])
    assert not col.quantize_fp8()  # already fp8: nothing to do


def test_quantization_rules_name_the_field(tmp_path):
    import hf_models as H

    from actors.models.loader import load_model
    from cluster.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="model.quantization='int4': must be null or 'fp8'"):
        config_from_dict({"model": {"quantization": "int4"}})
    H.save_hf_model("llama", str(tmp_path))
    # Checked before anything touches a GPU, so this machine's lack of one does not matter.
    with pytest.raises(ConfigError, match="model.quantization='fp8'.*set model.dtype=bfloat16"):
        load_model(str(tmp_path), dtype="float32", device="cuda", quantization="fp8")
    model, _ = load_model(str(tmp_path), dtype="float32", quantization="fp8")
    linears = [m for m in model.modules() if hasattr(m, "weight_fp8")]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
