"""The input-preparation kernels (kvcore/kernels/input_prep.py) against their torch reference, under
TRITON_INTERPRET=1: random batches of prefill chunks, decodes fed from the device and host tokens,
unpadded and padded to a bucket (padding sequences empty, padding tokens id 0 at position 0)."""

import numpy as np
import pytest
import torch

from actors.worker.input_prep import InputStager
from kvcore.kernels.input_prep import PrepOutputs, prepare_inputs, prepare_inputs_ref

MAX_REQS, MAX_TOKENS, MAX_LEN = 12, 96, 64


def random_step(rng, num_reqs):
    num_sched = rng.integers(1, 9, num_reqs) * (rng.random(num_reqs) < 0.5) + 1
    computed = rng.integers(0, 40, num_reqs)
    feed = np.where((num_sched == 1) & (rng.random(num_reqs) < 0.7), rng.integers(0, MAX_REQS, num_reqs), -1)
    known = computed + num_sched - (feed >= 0)  # a fed row's host lacks the token it is fed
    return num_sched.astype(np.int64), computed.astype(np.int64), known, feed.astype(np.int64)


def outputs():
    return PrepOutputs(
        query_start_loc=torch.full((MAX_REQS + 1,), -7, dtype=torch.int32),
        seq_lens=torch.full((MAX_REQS,), -7, dtype=torch.int32),
        logits_indices=torch.full((MAX_REQS,), -7, dtype=torch.int64),
        input_ids=torch.full((MAX_TOKENS,), -7, dtype=torch.int64),
        positions=torch.full((MAX_TOKENS,), -7, dtype=torch.int64),
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad", [False, True])
def test_kernels_match_reference(seed, pad):
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, MAX_REQS + 1))
    num_sched, computed, known, feed = random_step(rng, num_reqs)
    token_ids = rng.integers(0, 1000, (MAX_REQS, MAX_LEN)).astype(np.int32)
    stager = InputStager(MAX_REQS, MAX_TOKENS, torch.device("cpu"), pin_memory=False)
    stager.fed.copy_(torch.arange(MAX_REQS) + 5000)
    staged = stager.stage_step(num_sched, computed, known, feed, token_ids)
    num_seqs = MAX_REQS if pad else num_reqs
    num_tokens = MAX_TOKENS if pad else staged.num_tokens
    got, ref = outputs(), outputs()
    prepare_inputs(stager.stage, stager.layout, stager.fed, got, num_seqs, num_tokens, use_triton=True)
    prepare_inputs_ref(stager.stage, stager.layout, stager.fed, ref, num_seqs, num_tokens)
    for name in ("query_start_loc", "seq_lens", "logits_indices", "input_ids", "positions"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name

    # And the reference against the plain definition.
    cu = np.concatenate([[0], np.cumsum(num_sched)])
    assert ref.query_start_loc[: num_reqs + 1].tolist() == cu.tolist()
    assert ref.query_start_loc[num_reqs + 1 : num_seqs + 1].tolist() == [cu[-1]] * (num_seqs - num_reqs)
    assert ref.seq_lens[:num_reqs].tolist() == (computed + num_sched).tolist()
    ids, pos = [], []
    for r in range(num_reqs):
        for j in range(num_sched[r]):
            p = computed[r] + j
            pos.append(p)
            ids.append(5000 + feed[r] if (feed[r] >= 0 and j == 0) else token_ids[r, p])
    total = len(ids)
    assert ref.input_ids[:total].tolist() == ids and ref.positions[:total].tolist() == pos
    assert ref.input_ids[total:num_tokens].tolist() == [0] * (num_tokens - total)
    sample = staged.sample_rows
    assert sample.tolist() == [r for r in range(num_reqs) if computed[r] + num_sched[r] >= known[r]]
    assert ref.logits_indices[: len(sample)].tolist() == (cu[sample + 1] - 1).tolist()


def test_empty_step_is_all_padding():
    stager = InputStager(MAX_REQS, MAX_TOKENS, torch.device("cpu"), pin_memory=False)
    empty = np.zeros(0, dtype=np.int64)
    stager.stage_step(empty, empty, empty, empty, np.zeros((MAX_REQS, MAX_LEN), dtype=np.int32))
    got = outputs()
    prepare_inputs(stager.stage, stager.layout, stager.fed, got, 4, 32, use_triton=True)
    assert got.query_start_loc[:5].tolist() == [0] * 5
    assert got.input_ids[:32].tolist() == [0] * 32 and got.positions[:32].tolist() == [0] * 32
