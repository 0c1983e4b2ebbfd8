"""The two-launch logprobs kernel (actors/logprobs_kernel.py) against the torch reference
(compute_logprobs), under the Triton interpreter: several chunks with a partial last one, bf16-valued
logits full of exact ties (as an LM head makes them), k from 0 to MAX_LOGPROBS, and the sampler's
dispatch to it."""

from __future__ import annotations

import pytest
import torch

from actors.logprobs import MAX_LOGPROBS, compute_logprobs
from actors.logprobs_kernel import topk_logprobs
from actors.sampler import Sampler, SamplingMetadata


def logits_of(rows: int, vocab: int, bf16_values: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    if bf16_values:
        logits = logits.bfloat16().float()
    return logits, torch.randint(0, vocab, (rows,), generator=g)


def assert_matches_reference(logits: torch.Tensor, tokens: torch.Tensor, k: int, block: int) -> None:
    got = topk_logprobs(logits, tokens, k, block=block)
    ref = compute_logprobs(logits, tokens, k)
    lp = logits.log_softmax(-1)
    assert got.token_ids.shape == ref.token_ids.shape == (len(tokens), 1 + k) and got.token_ids.dtype == torch.int32
    assert torch.equal(got.token_ids[:, 0], ref.token_ids[:, 0])
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    # Ranks by raw logit: the reference's order without its rounding (bf16 values are far apart enough
    # that the two agree; asserted below).
    raw_rank = (logits >= logits.gather(1, tokens.unsqueeze(1))).sum(-1)
    assert torch.equal(got.ranks.long(), raw_rank)
    for row in range(len(tokens)):
        ids = got.token_ids[row, 1:].long()
        assert len(set(ids.tolist())) == k  # distinct tokens
        # Each reported id carries its own logprob, and the values are the reference's top-k (ties may
        # name other ids of the same value).
        torch.testing.assert_close(got.logprobs[row, 1:], lp[row, ids], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.logprobs[row, 1:], ref.logprobs[row, 1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_fp32_logits_over_several_chunks(k: int) -> None:
    logits, tokens = logits_of(6, 1000, bf16_values=False)  # 4 chunks of 256, the last one 232 wide
    assert_matches_reference(logits, tokens, k, block=256)


def test_bf16_valued_logits_with_ties_and_max_k() -> None:
    logits, tokens = logits_of(2, 400, bf16_values=True, seed=1)
    assert_matches_reference(logits, tokens, MAX_LOGPROBS, block=128)
    lp = logits.log_softmax(-1)
    ref_rank = (lp >= lp.gather(1, tokens.unsqueeze(1))).sum(-1)
    assert torch.equal(topk_logprobs(logits, tokens, 1, block=128).ranks.long(), ref_rank)


def test_ties_take_the_lowest_token_ids_across_chunks() -> None:
    logits = torch.zeros(1, 64)
    logits[0, [50, 3, 40, 20]] = 2.0  # four equal maxima in three chunks of 16
    logits[0, 7] = 1.0
    got = topk_logprobs(logits, torch.tensor([7]), 3, block=16)
    assert got.token_ids[0].tolist() == [7, 3, 20, 40]
    assert int(got.ranks[0]) == 5  # the four 2.0s and itself


def test_bf16_logits_and_an_empty_step() -> None:
    logits, tokens = logits_of(3, 300, bf16_values=True, seed=2)
    got = topk_logprobs(logits.bfloat16(), tokens, 2, block=128)
    ref = compute_logprobs(logits, tokens, 2)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    empty = topk_logprobs(logits[:0], tokens[:0], 4)
    assert empty.token_ids.shape == (0, 5) and empty.ranks.shape == (0,)


def test_the_triton_sampler_returns_the_kernels_logprobs() -> None:
    logits, _ = logits_of(5, 300, bf16_values=False, seed=3)
    md = SamplingMetadata(None, None, None, None, None, all_greedy=True, need_filter=False, num_logprobs=3)
    out = Sampler(use_triton=True)(logits, md)
    ref = compute_logprobs(logits, out.token_ids, 3)
    assert out.logprobs is not None
    assert torch.equal(out.logprobs.ranks, ref.ranks) and torch.equal(out.logprobs.token_ids[:, 0], ref.token_ids[:, 0])
    torch.testing.assert_close(out.logprobs.logprobs, ref.logprobs, atol=1e-5, rtol=0)
