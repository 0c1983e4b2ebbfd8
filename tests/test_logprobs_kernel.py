"""The two-launch logprobs kernel (actors/sample/logprobs_kernel.py) against the torch reference
(logprobs_reference), under the Triton interpreter: several chunks with a partial last one, bf16-valued
logits full of exact ties (as an LM head makes them), k from 0 to MAX_LOGPROBS, and compute_logprobs'
dispatch to it, for the sampler's rows and the prompt's."""

from __future__ import annotations

import pytest
import torch

from actors.sample import step_logprobs
from actors.sample.logprobs import MAX_LOGPROBS, LogprobsTensors, compute_logprobs, logprobs_reference
from actors.sample.logprobs_kernel import BLOCK, topk_logprobs
from actors.sample.sampler import Sampler, SamplingMetadata
from actors.sample.step_logprobs import PromptPlan, compute_prompt_logprobs


def logits_of(rows: int, vocab: int, bf16_values: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    if bf16_values:
        logits = logits.bfloat16().float()
    return logits, torch.randint(0, vocab, (rows,), generator=g)


def kernel(logits: torch.Tensor, tokens: torch.Tensor, k: int, block: int = BLOCK) -> LogprobsTensors:
    return LogprobsTensors(*topk_logprobs(logits, tokens, k, block=block))


def assert_matches_reference(logits: torch.Tensor, tokens: torch.Tensor, k: int, block: int) -> None:
    got = kernel(logits, tokens, k, block=block)
    ref = logprobs_reference(logits, tokens, k)
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
    assert torch.equal(kernel(logits, tokens, 1, block=128).ranks.long(), ref_rank)


def test_ties_take_the_lowest_token_ids_across_chunks() -> None:
    logits = torch.zeros(1, 64)
    logits[0, [50, 3, 40, 20]] = 2.0  # four equal maxima in three chunks of 16
    logits[0, 7] = 1.0
    got = kernel(logits, torch.tensor([7]), 3, block=16)
    assert got.token_ids[0].tolist() == [7, 3, 20, 40]
    assert int(got.ranks[0]) == 5  # the four 2.0s and itself


def test_bf16_logits_and_an_empty_step() -> None:
    logits, tokens = logits_of(3, 300, bf16_values=True, seed=2)
    got = kernel(logits.bfloat16(), tokens, 2, block=128)
    ref = logprobs_reference(logits, tokens, 2)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    empty = kernel(logits[:0], tokens[:0], 4)
    assert empty.token_ids.shape == (0, 5) and empty.ranks.shape == (0,)


def test_the_triton_sampler_returns_the_kernels_logprobs() -> None:
    logits, _ = logits_of(5, 300, bf16_values=False, seed=3)
    md = SamplingMetadata(None, None, None, None, None, all_greedy=True, need_filter=False, num_logprobs=3)
    out = Sampler(use_triton=True)(logits, md)
    ref = logprobs_reference(logits, out.token_ids, 3)
    assert out.logprobs is not None
    assert torch.equal(out.logprobs.ranks, ref.ranks) and torch.equal(out.logprobs.token_ids[:, 0], ref.token_ids[:, 0])
    torch.testing.assert_close(out.logprobs.logprobs, ref.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_logprobs_kernel_equals_torch_across_slices(dtype: torch.dtype, monkeypatch) -> None:
    """compute_prompt_logprobs (the runner's prompt path) through the kernel and through torch, over
    three slices of rows (PROMPT_SLICE shrunk to 4; the last slice partial) of a two-segment plan."""
    monkeypatch.setattr(step_logprobs, "PROMPT_SLICE", 4)
    logits, targets = logits_of(10, 300, bf16_values=dtype == torch.bfloat16, seed=4)
    hidden = logits.to(dtype)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(5)).numpy()
    plan = PromptPlan(order, targets.numpy(), [("a", 6, 2), ("b", 4, 3)], 3)

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        return h.float()  # as the LM head hands them over

    got = compute_prompt_logprobs(compute_logits, hidden, plan, use_triton=True)
    ref = compute_prompt_logprobs(compute_logits, hidden, plan, use_triton=False)
    assert got.token_ids.shape == ref.token_ids.shape == (10, 4)
    assert torch.equal(got.token_ids[:, 0], targets.int()) and torch.equal(got.ranks, ref.ranks)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    lp = hidden.float()[torch.from_numpy(order)].log_softmax(-1)
    for row in range(10):  # each top id carries its own logprob (tied values may name other ids)
        ids = got.token_ids[row, 1:].long()
        torch.testing.assert_close(got.logprobs[row, 1:], lp[row, ids], atol=1e-5, rtol=0)


def test_topk_ties_inside_one_chunk_span_rounds_and_chunks() -> None:
    """A chunk's max repeated within the chunk (the first round's pick is the chunk max, the next rounds
    the repeats), the same value in the next chunk's first round, and a whole row of one value: the
    lowest ids, in order, and every rank counts the ties."""
    logits = torch.zeros(2, 40)
    logits[0, [9, 2, 5, 17, 33]] = 3.0  # chunk 0 (ids 0-15): 2, 5, 9; chunk 1: 17; chunk 2: 33
    logits[0, 1] = 2.0
    got = kernel(logits, torch.tensor([1, 39]), 6, block=16)
    assert got.token_ids[0].tolist() == [1, 2, 5, 9, 17, 33, 1]
    assert got.token_ids[1].tolist() == [39, 0, 1, 2, 3, 4, 5]  # a row of ties: ids 0..5
    assert got.ranks.tolist() == [6, 40]
    torch.testing.assert_close(got.logprobs, logprobs_reference(logits, torch.tensor([1, 39]), 6).logprobs)


def test_compute_logprobs_dispatch() -> None:
    """One rule for sampled and prompt rows: the torch reference on the CPU unless use_triton says so."""
    logits, tokens = logits_of(3, 300, bf16_values=True, seed=6)
    on_cpu, ref = compute_logprobs(logits, tokens, 4), logprobs_reference(logits, tokens, 4)
    forced, kern = compute_logprobs(logits, tokens, 4, use_triton=True), kernel(logits, tokens, 4)
    for a, b in ((on_cpu, ref), (forced, kern)):
        for name in ("token_ids", "logprobs", "ranks"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
