"""Programmatic dependent launch (kvcore/kernels/pdl.py): when kernels launch with it. On a Hopper GPU
(TRITON_INTERPRET=0), a decode layer's chain of kernels captured in a CUDA graph with PDL gives the bits of
the same chain launched one after the other without it."""

import os

import pytest
import torch

import kvcore.kernels.pdl as pdl
from actors.layers.kernels.rms_norm import rms_norm_triton
from actors.layers.kernels.small_m_gemm import GemmConfig, small_m_linear, small_m_silu_mul

ON_HOPPER = (
    os.environ["TRITON_INTERPRET"] != "1" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
)


def test_pdl_is_off_on_the_cpu_under_the_interpreter_above_its_rows_and_by_the_switch(monkeypatch):
    monkeypatch.setattr(pdl, "MAX_ROWS", 16)
    assert not pdl.pdl_enabled(torch.device("cpu"), 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(torch.device("cuda", 0), 1)  # decided before any CUDA call
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0), 17)  # a step of many rows keeps plain launches
    monkeypatch.setattr(pdl, "MAX_ROWS", 0)
    assert not pdl.pdl_enabled(torch.device("cuda", 0), 1)


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

    monkeypatch.setattr(pdl, "MAX_ROWS", 0)
    want = [layer_chain(x * (i + 1), res, norm_w, ws) for i in range(3)]
    monkeypatch.setattr(pdl, "MAX_ROWS", 16)
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
