"""The small-M GEMM over 16-bit weights (actors/layers/kernels/small_m_gemm.py) against its torch reference
under TRITON_INTERPRET=1, and the per-device table that decides where the engine uses it
(actors/layers/kernels/small_m_tuned.py). The fp8 form of the same kernel: tests/test_fp8_linear.py."""

import json

import pytest
import torch

from actors.layers.kernels import small_m_tuned
from actors.layers.kernels.silu_mul import silu_and_mul_triton
from actors.layers.kernels.small_m_gemm import GemmConfig, small_m_linear, small_m_linear_ref, small_m_silu_mul


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
