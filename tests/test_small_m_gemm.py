"""The small-M GEMM over 16-bit weights (actors/layers/kernels/small_m_gemm.py) against its torch reference
under TRITON_INTERPRET=1, and the per-device table that decides where the engine uses it
(actors/layers/kernels/small_m_tuned.py). The fp8 form of the same kernel: tests/test_fp8_linear.py."""

import json
import os

import pytest
import torch

from actors.layers.kernels import small_m_gemm, small_m_tuned
from actors.layers.kernels.layer_reference import rms_norm_ref
from actors.layers.kernels.rms_norm import rms_norm_triton
from actors.layers.kernels.silu_mul import silu_and_mul_triton
from actors.layers.kernels.small_m_gemm import (
    GemmConfig,
    ResidualNorm,
    small_m_linear,
    small_m_linear_ref,
    small_m_norm_linear,
    small_m_norm_silu_mul,
    small_m_silu_mul,
)


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (1, 96, 256, GemmConfig(block_n=32, block_k=128)),  # K even in tiles, no split
        (3, 70, 200, GemmConfig(block_n=32, block_k=64)),  # ragged N and K: the masks
        (5, 64, 512, GemmConfig(block_n=32, block_k=64, split_k=4)),  # split K: fp32 partials, then the reduce
        (17, 40, 96, GemmConfig(block_n=32, block_k=32, split_k=2)),  # two row tiles (BLOCK_M 32)
        (130, 40, 96, GemmConfig(block_n=32, block_k=32, split_k=2, block_m=128)),  # its own row tile, ragged
    ],
)
def test_the_kernel_matches_its_reference(m, n, k, config, dtype):
    x, w = operands(m, n, k, dtype)
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        y = small_m_linear(x, w, b, dtype, config=config)
        ref = small_m_linear_ref(x, w, b)
        assert y.shape == (m, n) and y.dtype == dtype
        # fp32 accumulation in another order, one rounding to 16 bits: at most one unit of the last place
        torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (1, 48, 256, GemmConfig(block_n=32, block_k=128)),  # K even in tiles; the second tile of N half empty
        (3, 35, 200, GemmConfig(block_n=16, block_k=64)),  # ragged N and K: the masks
        (17, 40, 96, GemmConfig(block_n=32, block_k=32)),  # two row tiles (BLOCK_M 32)
    ],
)
def test_the_gated_form_equals_the_gemm_then_the_activation(m, n, k, config, dtype):
    """silu(gate) * up in the GEMM's epilogue against the two launches it replaces (the GEMM rounds its
    [gate | up] output to 16 bits, SiluAndMul's kernel rounds silu and the product) and the torch layer."""
    x, w = operands(m, 2 * n, k, dtype, seed=m)
    y = small_m_silu_mul(x, w, config=config)
    assert y.shape == (m, n) and y.dtype == dtype
    two_launches = silu_and_mul_triton(small_m_linear(x, w, None, dtype, config=config))
    if dtype == torch.float16:
        torch.testing.assert_close(y, two_launches, rtol=0, atol=0)
    else:  # the interpreter casts the GEMM's fp32 to bf16 by truncation; the epilogue rounds to nearest
        torch.testing.assert_close(y.float(), two_launches.float(), rtol=2**-5, atol=1e-3)
    gate_up = small_m_linear_ref(x, w, None)
    torch_layer = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10  # the GEMM's one rounding, then the activation's two
    torch.testing.assert_close(y.float(), torch_layer.float(), rtol=2 * tol, atol=1e-3)


def residual_norm(m: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ResidualNorm]:
    """The previous block's output x and a pre-norm block's residual and norm weight, at HF-like scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    residual = (4 * torch.randn(m, k, generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    return x, ResidualNorm(residual, weight, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (1, 96, 256, GemmConfig(block_n=32, block_k=128)),  # K even in tiles, no split
        (3, 70, 200, GemmConfig(block_n=32, block_k=64)),  # ragged N and K: the masks of the norm's pass too
        (5, 64, 512, GemmConfig(block_n=32, block_k=64, split_k=4)),  # each K split normalises its own columns
        (17, 40, 96, GemmConfig(block_n=16, block_k=32, split_k=2)),  # two row tiles, three N tiles
    ],
)
@pytest.mark.parametrize("norm_tile", [4096, 64])  # the norm pass in one tile, or in several along K
def test_the_norm_inside_the_gemm_equals_the_norm_then_the_gemm(m, n, k, config, dtype, norm_tile, monkeypatch):
    """RMSNorm(x + residual) computed by the GEMM's programs against the two launches it replaces (the
    RMSNorm kernel, then the GEMM) and the torch layers; x + residual comes back exactly."""
    monkeypatch.setattr(small_m_gemm, "NORM_TILE", norm_tile)
    x, norm = residual_norm(m, k, dtype, seed=m)
    _, w = operands(m, n, k, dtype, seed=m + 1)
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        y, res = small_m_norm_linear(x, norm, w, b, config)
        assert y.shape == (m, n) and y.dtype == dtype and res.shape == (m, k)
        normed, res_two = rms_norm_triton(x, norm.weight, norm.eps, norm.residual)
        torch.testing.assert_close(res, res_two, rtol=0, atol=0)
        torch.testing.assert_close(res, x + norm.residual, rtol=0, atol=0)
        two_launches = small_m_linear(normed, w, b, dtype, config=config)
        # The norm's sum of squares in another order: an element of the operand may round the other way.
        tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
        torch.testing.assert_close(y.float(), two_launches.float(), rtol=tol, atol=1e-2)
        ref_normed, _ = rms_norm_ref(x, norm.weight, norm.eps, norm.residual)
        torch.testing.assert_close(y.float(), small_m_linear_ref(ref_normed, w, b).float(), rtol=tol, atol=1e-2)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("gated", [False, True])
def test_the_norm_inside_the_gemm_in_the_engines_tiles_at_llamas_width(m, gated):
    """The tiles the engine launches at Llama-3.1-8B's hidden size (the H100 table's qkv entry, the gated
    form's own): at one row the norm pass reads the row of 4,096 as one tile; at 16 it fills the row tile.
    N is cut to two tiles (the interpreter's time), K is the model's."""
    dtype, k = torch.bfloat16, 4096
    x, norm = residual_norm(m, k, dtype, seed=m)
    n = 128 if not gated else 64
    _, w = operands(m, 2 * n if gated else n, k, dtype, seed=7)
    normed, res_two = rms_norm_triton(x, norm.weight, norm.eps, norm.residual)
    if gated:
        y, res = small_m_norm_silu_mul(x, norm, w)
        two = small_m_silu_mul(normed, w)
    else:
        config = GemmConfig(block_n=64, block_k=256, split_k=1, num_stages=4, num_warps=4)
        y, res = small_m_norm_linear(x, norm, w, None, config)
        two = small_m_linear(normed, w, None, dtype, config=config)
    torch.testing.assert_close(res, res_two, rtol=0, atol=0)
    torch.testing.assert_close(y.float(), two.float(), rtol=2**-6, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,config",
    [(1, 48, 256, GemmConfig(block_n=32, block_k=128)), (3, 35, 200, GemmConfig(block_n=16, block_k=64))],
)
def test_the_norm_inside_the_gated_form(m, n, k, config, dtype):
    x, norm = residual_norm(m, k, dtype, seed=m)
    _, w = operands(m, 2 * n, k, dtype, seed=m + 1)
    y, res = small_m_norm_silu_mul(x, norm, w, config)
    assert y.shape == (m, n) and y.dtype == dtype
    normed, res_two = rms_norm_triton(x, norm.weight, norm.eps, norm.residual)
    torch.testing.assert_close(res, res_two, rtol=0, atol=0)
    two_launches = small_m_silu_mul(normed, w, config=config)
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(y.float(), two_launches.float(), rtol=2 * tol, atol=1e-2)


def test_the_norm_inside_the_gemm_refuses_mixed_dtypes_and_shapes():
    x, norm = residual_norm(2, 64, torch.bfloat16, seed=0)
    _, w = operands(2, 32, 64, torch.bfloat16)
    config = GemmConfig(block_n=32, block_k=64)
    with pytest.raises(ValueError, match="must share one 16-bit dtype"):
        small_m_norm_linear(x, ResidualNorm(norm.residual, norm.weight.float(), 1e-6), w, None, config)
    with pytest.raises(ValueError, match="must share one 16-bit dtype"):
        small_m_norm_linear(x.float(), norm, w.float(), None, config)
    with pytest.raises(ValueError, match=r"residual \(1, 64\) must be x's shape"):
        small_m_norm_linear(x, ResidualNorm(norm.residual[:1], norm.weight, 1e-6), w, None, config)
    with pytest.raises(ValueError, match=r"norm weight \(32,\) must be \[64\]"):
        small_m_norm_linear(x, ResidualNorm(norm.residual, norm.weight[:32], 1e-6), w, None, config)
    y, res = small_m_norm_linear(x[:0], ResidualNorm(norm.residual[:0], norm.weight, 1e-6), w, None, config)
    assert y.shape == (0, 32) and res.shape == (0, 64)


def test_the_gated_form_refuses_float32_and_the_layer_keeps_two_launches_there():
    """float32 tiles of the gated form's size overflow an H100's shared memory: the kernel refuses them,
    and the gate/up layer leaves them (and CPU tensors) to the GEMM and SiluAndMul."""
    from actors.layers.linear import MergedColumnParallelLinear

    x, w = operands(2, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        small_m_silu_mul(x, w)
    layer = MergedColumnParallelLinear(64, [4, 4], False, torch.float32)
    assert layer.silu_and_mul(x) is None
    fake_cuda = type("FakeCuda", (), {"is_cuda": True, "dtype": torch.float32})()
    assert layer.silu_and_mul(fake_cuda) is None  # a float32 weight, even on a GPU


def test_only_an_unbiased_16_bit_pair_of_equal_halves_takes_the_gated_form():
    from actors.layers.linear import MergedColumnParallelLinear

    def gated(sizes: list[int], bias: bool, dtype: torch.dtype) -> bool:
        return MergedColumnParallelLinear(64, sizes, bias, dtype)._gated_epilogue

    assert gated([8, 8], False, torch.bfloat16) and gated([8, 8], False, torch.float16)
    assert not gated([8, 8], True, torch.bfloat16)  # the epilogue adds no bias
    assert not gated([8, 16], False, torch.bfloat16) and not gated([8, 8, 8], False, torch.bfloat16)
    assert not gated([8, 8], False, torch.float32)


def test_the_gated_form_refuses_an_odd_or_foreign_weight():
    x, w = operands(2, 7, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be \[2N, K\]"):
        small_m_silu_mul(x, w)
    with pytest.raises(ValueError, match=r"must be \[2N, K\]"):
        small_m_silu_mul(x, operands(2, 8, 64, torch.float16)[1])


def test_a_strided_row_view_and_no_rows():
    x, w = operands(4, 48, 128, torch.bfloat16)
    wide = torch.cat([x, x], dim=1)[:, :128]  # rows strided, columns unit-stride (a slice of a fused output)
    torch.testing.assert_close(
        small_m_linear(wide, w, None, torch.bfloat16, config=GemmConfig(block_n=32, block_k=64)).float(),
        small_m_linear_ref(x, w, None).float(),
        rtol=2**-7,
        atol=1e-3,
    )
    assert small_m_linear(x[:0], w, None, torch.bfloat16).shape == (0, 48)


def test_unscaled_weights_must_match_the_activations_dtype():
    x, w = operands(1, 32, 64, torch.bfloat16)
    with pytest.raises(TypeError, match="weight torch.float16 and activations torch.bfloat16"):
        small_m_linear(x, w.half(), None, torch.bfloat16)


class FakeCudaWeight:
    """What tuned_config reads of a weight: device, dtype, shape (the lookup itself runs on no GPU)."""

    def __init__(self, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.is_cuda, self.dtype, self.shape = True, dtype, (n, k)
        self.device = torch.device("cuda", 0)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A device table in a temporary folder, for a device named "Test GPU 80GB"."""
    monkeypatch.setattr(small_m_tuned, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(small_m_tuned, "_device_name", lambda index: "Test GPU 80GB")
    small_m_tuned._table.cache_clear()
    path = small_m_tuned.table_path("Test GPU 80GB", torch.bfloat16)
    assert path.name == "Test_GPU_80GB-bfloat16.json"
    shapes = {
        "4096x4096": {"1": [64, 256, 1, 4, 4], "8": [128, 128, 2, 3, 8]},
        "1024x2048": {"16": None, "64": [64, 64, 2, 3, 4], "256": [128, 64, 1, 3, 8, 128], "512": None},
    }
    path.write_text(json.dumps({"device": "Test GPU 80GB", "dtype": "bfloat16", "shapes": shapes}))
    yield
    small_m_tuned._table.cache_clear()


def test_a_step_takes_the_smallest_tuned_row_count_at_or_above_it(table):
    w = FakeCudaWeight(4096, 4096)
    assert small_m_tuned.tuned_config(1, w) == GemmConfig(64, 256, 1, 4, 4)
    assert small_m_tuned.tuned_config(2, w) == GemmConfig(128, 128, 2, 3, 8)
    assert small_m_tuned.tuned_config(8, w) == GemmConfig(128, 128, 2, 3, 8)
    assert small_m_tuned.tuned_config(9, w) is None  # past the table: cuBLAS
    assert small_m_tuned.tuned_config(0, w) is None


def test_null_entries_keep_torch_and_a_sixth_number_is_the_row_tile(table, monkeypatch):
    w = FakeCudaWeight(1024, 2048)
    assert small_m_tuned.tuned_config(1, w) is None  # 16 measured faster on cuBLAS, and it covers 1..16
    assert small_m_tuned.tuned_config(16, w) is None
    assert small_m_tuned.tuned_config(17, w) == GemmConfig(64, 64, 2, 3, 4)
    assert small_m_tuned.tuned_config(200, w) == GemmConfig(128, 64, 1, 3, 8, block_m=128)
    assert small_m_tuned.tuned_config(200, w).rows_per_program(200) == 128
    assert small_m_tuned.tuned_config(300, w) is None
    monkeypatch.setattr(small_m_tuned, "MAX_ROWS", 64)  # KVRAY_SMALL_M_MAX_ROWS=64
    assert small_m_tuned.tuned_config(64, w) == GemmConfig(64, 64, 2, 3, 4)
    assert small_m_tuned.tuned_config(65, w) is None


def test_untuned_shapes_dtypes_devices_and_the_switch_keep_torch(table, monkeypatch):
    assert small_m_tuned.tuned_config(1, FakeCudaWeight(4096, 1024)) is None  # shape not measured
    assert small_m_tuned.tuned_config(1, FakeCudaWeight(4096, 4096, torch.float32)) is None  # fp32: HF's oracle
    assert small_m_tuned.tuned_config(1, FakeCudaWeight(4096, 4096, torch.float16)) is None  # no fp16 table
    assert small_m_tuned.tuned_config(1, torch.empty(4096, 4096, dtype=torch.bfloat16)) is None  # CPU
    monkeypatch.setattr(small_m_tuned, "_device_name", lambda index: "Another GPU")
    assert small_m_tuned.tuned_config(1, FakeCudaWeight(4096, 4096)) is None  # no table for that device
    monkeypatch.setattr(small_m_tuned, "ENABLED", False)
    monkeypatch.setattr(small_m_tuned, "_device_name", lambda index: "Test GPU 80GB")
    assert small_m_tuned.tuned_config(1, FakeCudaWeight(4096, 4096)) is None  # KVRAY_SMALL_M_GEMM=0


def test_the_shipped_tables_load_and_name_their_device():
    paths = sorted(small_m_tuned.CONFIG_DIR.glob("*.json"))
    assert paths, "no measured table ships with the package"
    for path in paths:
        raw = json.loads(path.read_text())
        assert small_m_tuned.table_path(raw["device"], torch.bfloat16) == path
        table = small_m_tuned._table(raw["device"], torch.bfloat16)
        assert table and all(ms == sorted(ms) and len(ms) == len(cs) for ms, cs in table.values())


def test_a_tuning_run_replaces_the_rows_it_measured_and_keeps_the_rest(tmp_path):
    from benchmarks.kernels.bench_small_m_gemm import merge_table

    path = tmp_path / "t.json"
    old = {"4096x4096": {"1": [64, 256, 1, 4, 4], "16": [64, 128, 1, 4, 4]}, "1024x2048": {"1": [64, 128, 4, 4, 4]}}
    path.write_text(json.dumps({"device": "Test GPU", "dtype": "bfloat16", "shapes": old}))
    wide = GemmConfig(block_n=128, block_k=64, split_k=1, num_stages=3, num_warps=8, block_m=128)
    measured = {"4096x4096": {"16": None, "256": small_m_tuned.config_entry(wide)}, "6144x1024": {"32": None}}
    merged = merge_table(path, "Test GPU", measured)
    assert merged["shapes"] == {
        "4096x4096": {"1": [64, 256, 1, 4, 4], "16": None, "256": [128, 64, 1, 3, 8, 128]},
        "1024x2048": {"1": [64, 128, 4, 4, 4]},
        "6144x1024": {"32": None},
    }
    assert small_m_tuned.config_entry(GemmConfig()) == [64, 256, 1, 4, 4]  # the five-number form the shipped tables use
    assert GemmConfig(*merged["shapes"]["4096x4096"]["256"]) == wide


def test_the_layers_put_the_norm_inside_their_gemms_for_a_decode_steps_rows(monkeypatch):
    """The wiring, with the GPU's decisions forced on this CPU (the kernels run in the interpreter): switched
    on, the QKV layer and the MLP take the norm into their GEMMs at up to KVRAY_FUSED_NORM_MAX_M rows and give what
    the norm launch followed by the layer gives; past the limit, or with no tuned config for the QKV shape,
    the norm launch stays."""
    from types import SimpleNamespace

    from actors.layers import linear
    from actors.layers.norm import RMSNorm
    from actors.models.decoder import DecoderMLP

    dtype, hidden, inter = torch.bfloat16, 64, 96
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6, dtype, backend="triton")
    norm.weight.data = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    qkv = linear.QKVParallelLinear(hidden, 16, 2, 1, False, dtype)
    qkv.weight.data = (torch.randn(qkv.weight.shape) / hidden**0.5).to(dtype)
    mlp = DecoderMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter, mlp_bias=False), dtype, "triton")
    for p in mlp.parameters():
        p.data = (torch.randn(p.shape) / p.shape[-1] ** 0.5).to(dtype)
    monkeypatch.setattr(linear, "on_gpu", lambda x: True)
    monkeypatch.setattr(linear, "tuned_config", lambda m, w: GemmConfig(block_n=32, block_k=32))
    x, rn = residual_norm(3, hidden, dtype, seed=3)
    monkeypatch.setattr(linear, "FUSED_NORM_MAX_M", 0)  # the default until a GPU has timed it
    assert qkv.norm_and_forward(x, rn.residual, norm) is None
    assert mlp.gate_up_proj.norm_silu_and_mul(x, rn.residual, norm) is None
    monkeypatch.setattr(linear, "FUSED_NORM_MAX_M", 16)  # KVRAY_FUSED_NORM_MAX_M=16

    normed, res_two = norm(x, rn.residual)
    fused = qkv.norm_and_forward(x, rn.residual, norm)
    assert fused is not None
    torch.testing.assert_close(fused[1], res_two, rtol=0, atol=0)
    torch.testing.assert_close(fused[0].float(), qkv(normed).float(), rtol=2**-7, atol=1e-2)

    out, res = mlp.norm_and_forward(x, rn.residual, norm)
    torch.testing.assert_close(res, res_two, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), mlp(normed).float(), rtol=2**-6, atol=2e-2)

    assert RMSNorm(hidden, 1e-6, dtype, backend="torch").inside_gemm(rn.residual) is None  # HF's ops on CPU
    monkeypatch.setattr(linear, "FUSED_NORM_MAX_M", 2)  # KVRAY_FUSED_NORM_MAX_M=2: three rows are too many
    assert qkv.norm_and_forward(x, rn.residual, norm) is None
    assert mlp.gate_up_proj.norm_silu_and_mul(x, rn.residual, norm) is None
    monkeypatch.setattr(linear, "FUSED_NORM_MAX_M", 16)
    monkeypatch.setattr(linear, "tuned_config", lambda m, w: None)  # cuBLAS measured faster for this shape
    assert qkv.norm_and_forward(x, rn.residual, norm) is None
    assert mlp.gate_up_proj.norm_silu_and_mul(x, rn.residual, norm) is not None  # its own tiles


ON_GPU = os.environ["TRITON_INTERPRET"] != "1" and torch.cuda.is_available()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (run with TRITON_INTERPRET=0)")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_on_the_gpu_the_norm_inside_llamas_qkv_and_gate_up_equals_the_norm_launch_then_the_gemm(m):
    """Llama-3.1-8B's shapes, the tiles of the shipped table's qkv entry: the operand's elements round as
    the RMSNorm kernel's do but for a last-bit tie here and there (the sum of squares in another order)."""
    g = torch.Generator(device="cuda").manual_seed(m)
    hidden, inter, dtype = 4096, 14336, torch.bfloat16

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(dtype)

    x, norm = rand(m, hidden), ResidualNorm(rand(m, hidden, scale=4), rand(hidden, scale=0.1) + 1, 1e-5)
    normed, res_two = rms_norm_triton(x, norm.weight, norm.eps, norm.residual)
    config = GemmConfig(block_n=64, block_k=256, split_k=2)
    w_qkv, w_gate_up = rand(6144, hidden, scale=hidden**-0.5), rand(2 * inter, hidden, scale=hidden**-0.5)
    y, res = small_m_norm_linear(x, norm, w_qkv, None, config)
    assert torch.equal(res, res_two)
    two = small_m_linear(normed, w_qkv, None, dtype, config=config)
    assert (y != two).float().mean() < 0.01
    torch.testing.assert_close(y.float(), two.float(), rtol=2**-7, atol=1e-2)
    y, res = small_m_norm_silu_mul(x, norm, w_gate_up)
    assert torch.equal(res, res_two)
    two = small_m_silu_mul(normed, w_gate_up)
    assert (y != two).float().mean() < 0.01
    torch.testing.assert_close(y.float(), two.float(), rtol=2**-6, atol=1e-2)
