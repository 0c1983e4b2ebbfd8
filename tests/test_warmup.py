"""The start-up warm-up's choices that the CPU can check: which LM-head row counts it runs (the GEMM
kernels load on the GPU; a count it skipped would be loaded inside a user's first steps)."""

import itertools

import pytest

from actors.worker.warmup import EVERY_COUNT_UP_TO, logits_row_counts


@pytest.mark.parametrize("max_rows", [1, 5, 16, 256, 257, 300, 1024])
def test_every_sampling_row_count_is_within_one_warm_step(max_rows):
    counts = logits_row_counts(max_rows)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] == max_rows
    # Every count up to 256 exactly; beyond it, no count further than 16 rows from a warmed one.
    assert set(range(1, min(max_rows, EVERY_COUNT_UP_TO) + 1)) <= set(counts)
    assert all(b - a <= 16 for a, b in itertools.pairwise(counts))
    assert len(counts) <= EVERY_COUNT_UP_TO + max(0, max_rows - EVERY_COUNT_UP_TO) // 16 + 1
