"""Programmatic dependent launch (kvcore/kernels/pdl.py): when kernels launch with it, and how much weight
the small-M GEMM prefetches before its wait. On a Hopper GPU (TRITON_INTERPRET=0), a decode layer's chain of
kernels captured in a CUDA graph with PDL gives the bits of the same chain launched one after the other
without it."""

import os

import pytest
import torch

import actors.layers.kernels.small_m_gemm as smg
import kvcore.kernels.pdl as pdl
from actors.layers.kernels.rms_norm import rms_norm_triton
from actors.layers.kernels.small_m_gemm import GemmConfig, small_m_linear, small_m_silu_mul

ON_HOPPER = (
    os.environ["TRITON_INTERPRET"] != "1" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
)


def test_pdl_is_off_on_the_cpu_under_the_interpreter_and_by_the_switch(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))  # decided before any CUDA call
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


class FakeWeight:
    """What prefetch_bytes reads of a weight: its row stride, element size and address."""

    def __init__(self, k: int, element_size: int = 2, address: int = 1 << 20) -> None:
        self.k, self.size, self.address = k, element_size, address

    def stride(self, dim: int) -> int:
        return self.k

    def element_size(self) -> int:
        return self.size

    def data_ptr(self) -> int:
        return self.address


def test_the_prefetch_spreads_the_budget_over_every_programs_rows(monkeypatch):
    monkeypatch.setattr(smg, "PREFETCH_BUDGET", 8 << 20)
    # Llama-3.1-8B's o projection at M = 1: 64 programs of 64 rows, K = 4096 in bf16 (8 KiB a row).
    assert smg.prefetch_bytes(FakeWeight(4096), 4096, 64, 64) == 2048  # 8 MiB / 4096 rows
    # gate_up, gated: 224 programs x (64 gate + 64 up rows): 292 bytes a row, down to a multiple of 16.
    assert smg.prefetch_bytes(FakeWeight(4096), 4096, 224, 128) == 288
    # Never past the program's own K range (a split's share, or a short K).
    assert smg.prefetch_bytes(FakeWeight(4096), 64, 4, 16) == 128
    assert smg.prefetch_bytes(FakeWeight(4096, element_size=1), 100, 4, 16) == 96  # e4m3: one byte an element


def test_no_prefetch_where_a_row_start_is_unaligned_or_the_budget_is_zero(monkeypatch):
    monkeypatch.setattr(smg, "PREFETCH_BUDGET", 8 << 20)
    assert smg.prefetch_bytes(FakeWeight(4100), 4100, 64, 64) == 0  # 8200-byte rows: not 16-byte aligned
    assert smg.prefetch_bytes(FakeWeight(4096, address=(1 << 20) + 8), 4096, 64, 64) == 0
    monkeypatch.setattr(smg, "PREFETCH_BUDGET", 0)
    assert smg.prefetch_bytes(FakeWeight(4096), 4096, 64, 64) == 0


def layer_chain(x: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor, ws: dict) -> torch.Tensor:
    """A decode layer's MLP half as the engine launches it at a few rows: residual + norm, a split-K
    projection and its reduce, gate/up + SiLU, down."""
    h, res2 = rms_norm_triton(x, norm_w, 1e-6, residual=res)
    h = small_m_linear(h, ws["o"], None, h.dtype, config=GemmConfig(block_n=64, block_k=128, split_k=4))
    h = small_m_silu_mul(h, ws["gate_up"])
    return small_m_linear(h, ws["down"], None, h.dtype) + res2


@pytest.mark.skipif(not ON_HOPPER, reason="PDL needs a GPU of compute capability >= 9.0 (run with TRITON_INTERPRET=0)")
def test_a_captured_chain_with_pdl_gives_the_bits_of_the_chain_without_it(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 1024, 2816

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") / shape[-1] ** 0.5).to(torch.bfloat16)

    ws = {"o": rand(hidden, hidden), "gate_up": rand(2 * inter, hidden), "down": rand(hidden, inter)}
    norm_w = rand(hidden) + 1
    x, res = rand(4, hidden), rand(4, hidden)

    monkeypatch.setattr(pdl, "ENABLED", False)
    want = [layer_chain(x * (i + 1), res, norm_w, ws) for i in range(3)]
    monkeypatch.setattr(pdl, "ENABLED", True)
    static_x = x.clone()
    layer_chain(static_x, res, norm_w, ws)  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer_chain(static_x, res, norm_w, ws)
    for i in range(3):
        static_x.copy_(x * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[i]), f"replay {i}"
