"""bench_serve.py's per-request figures, as vLLM's `bench serve` defines them: TPOT is per output token
even when a chunk carries many (serve.stream_batching_ms packs ~15 tokens a chunk at saturation)."""

from __future__ import annotations

import pytest

from benchmarks.e2e import bench_serve


@pytest.fixture(scope="module")
def bench():
    return bench_serve


def test_tpot_is_per_token_not_per_chunk(bench):
    # 31 tokens in 3 chunks (1, then 15, then 15) at 50 ms gaps: (0.1 s) / 30 tokens after the first
    o = bench.Outcome(True, ttft_s=0.02, itl_s=[0.05, 0.05], num_tokens=31)
    assert o.tpot_s == pytest.approx(0.1 / 30)
    assert bench.Outcome(True, ttft_s=0.02, itl_s=[0.004] * 9, num_tokens=10).tpot_s == pytest.approx(0.004)


def test_tpot_undefined_for_one_chunk(bench):
    assert bench.Outcome(True, ttft_s=0.02, itl_s=[], num_tokens=8).tpot_s is None
    r = bench.summarize(1.0, [bench.Outcome(True, 0.01, [0.05], 11)], elapsed=1.0)
    assert r["tpot_p50_ms"] == pytest.approx(5.0) and r["itl_p50_ms"] == pytest.approx(50.0)
