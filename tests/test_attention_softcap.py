"""Gemma-2's attention-logit soft-cap: the torch reference against a dense oracle written the way HF's
eager attention computes it, and the Triton kernel (under TRITON_INTERPRET=1) against the reference,
with windows, split-KV and both tile paths. The scale and cap are chosen so most scores saturate:
a kernel that ignored the cap, or capped after the log2(e) factor, would be far off."""

import pytest
import torch
from test_attention_kernels import SHAPES, assert_written_and_untouched, make_batch

from kvcore.kernels.ops import paged_attention
from kvcore.kernels.paged_attention import paged_attention_triton

SCALE, CAP = 0.9, 2.5


def hf_eager_oracle(batch, scale, window, softcap):
    """scores * scale -> cap * tanh(. / cap) -> + mask -> softmax -> @ V, per sequence, on contiguous K/V."""
    outs, start = [], 0
    q_all = batch["query"].cpu().float()
    for q_len, k, v in zip(batch["q_lens"], batch["keys"], batch["values"], strict=True):
        seq_len = k.shape[0]
        q = q_all[start : start + q_len].transpose(0, 1)
        rep = q.shape[0] // k.shape[1]
        kk = k.float().repeat_interleave(rep, 1).transpose(0, 1)
        vv = v.float().repeat_interleave(rep, 1).transpose(0, 1)
        w = q @ kk.transpose(1, 2) * scale
        w = torch.tanh(w / softcap) * softcap
        i = torch.arange(seq_len - q_len, seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        mask = j <= i
        if window is not None:
            mask &= j > i - window
        w = w.masked_fill(~mask, float("-inf"))
        outs.append((torch.softmax(w, -1) @ vv).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def run(batch, window, softcap, backend="torch", **triton_kw):
    out = torch.full_like(batch["query"], float("nan"))
    args = (
        batch["query"],
        batch["key_cache"],
        batch["value_cache"],
        out,
        batch["query_start_loc"],
        batch["seq_lens"],
        batch["block_table"][:-1],
        SCALE,
    )
    max_q, max_s = max(batch["q_lens"]), max(k.shape[0] for k in batch["keys"])
    if triton_kw:
        paged_attention_triton(*args, window, max_q, max_s, softcap=softcap, **triton_kw)
    else:
        paged_attention(
            *args, sliding_window=window, max_query_len=max_q, max_seq_len=max_s, backend=backend, softcap=softcap
        )
    return out.cpu()


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_reference_softcap_matches_hf_eager(kind, window):
    q_lens, seq_lens = SHAPES[kind]
    batch = make_batch(q_lens, seq_lens, 4, 2, 16, 4, torch.float32, window, seed=3)
    out = run(batch, window, CAP)
    n = batch["num_tokens"]
    assert_written_and_untouched(out, n)
    torch.testing.assert_close(out[:n], hf_eager_oracle(batch, SCALE, window, CAP), atol=1e-5, rtol=1e-5)
    uncapped = run(batch, window, None)
    assert (out[:n] - uncapped[:n]).abs().max() > 0.05, "the cap changed nothing: the test is too weak"


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_triton_softcap_matches_reference(kind, window):
    q_lens, seq_lens = SHAPES[kind]
    batch = make_batch(q_lens, seq_lens, 8, 2, 16, 4, torch.float32, window, seed=11)
    ref = run(batch, window, CAP)
    for kw in (dict(num_splits=1), dict(block_m=16, block_n=16), dict(num_splits=3, block_m=16, block_n=16)):
        out = run(batch, window, CAP, **kw)
        assert_written_and_untouched(out, batch["num_tokens"])
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, equal_nan=True)


def test_softcap_must_be_positive():
    q_lens, seq_lens = SHAPES["decode"]
    batch = make_batch(q_lens, seq_lens, 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        run(batch, None, -1.0)
