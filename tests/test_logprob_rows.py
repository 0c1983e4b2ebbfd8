"""A step's logprob rows travel as one batch: the worker sends the step's arrays with the rows' request
ids, every output of the step points at that batch, a message pickles it once (four arrays a step, not
per request), as the worker -> driver -> client path sends it, and each output reads its request's rows,
trimmed to its k."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from actors.messages import PollResult
from actors.sample.logprobs import compute_logprobs
from actors.sample.step_logprobs import LogprobsCollector, launch_copies
from kvcore.messages import EngineCoreOutput, Logprobs, LogprobsBatch, ModelRunnerOutput
from kvcore.sched.logprob_outputs import attach_logprobs


def step_batch(ks: list[int], rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, LogprobsBatch]:
    """A step of len(ks) rows; `rows` are the ones that sampled (default all)."""
    n = len(ks)
    rows = np.arange(n) if rows is None else rows
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(rows), 300, generator=g)
    tokens = torch.randint(0, 300, (len(rows),), generator=g)
    lp = compute_logprobs(logits, tokens, max(ks))
    step = launch_copies(lp, np.array(ks, dtype=np.int32)[rows], None, None, cuda=False)
    sampled, prompt = LogprobsCollector().collect(step, [f"r{i}" for i in range(n)], rows)
    assert prompt is None and sampled is not None
    return logits, tokens, sampled


def test_each_requests_rows_trimmed_to_its_k() -> None:
    ks = [5, -1, 0, 3, 5]
    logits, tokens, batch = step_batch(ks)
    lp = logits.log_softmax(-1)
    for i, k in enumerate(ks):
        m = EngineCoreOutput(f"r{i}", [int(tokens[i])], step_logprobs=batch).logprobs
        if k < 0:
            assert m is None  # asked for none: its row is the batch's only
            continue
        assert m is not None and len(m) == 1 and m.token_ids.shape == (1, 1 + k) == m.logprobs.shape
        tok = int(tokens[i])
        assert m.token_ids[0, 0] == tok and abs(float(m.logprobs[0, 0]) - float(lp[i, tok])) < 1e-5
        assert m.ranks.tolist() == [int((lp[i] >= lp[i, tok]).sum())]
        assert m.token_ids[0, 1:].tolist() == lp[i].topk(k).indices.tolist()
    assert EngineCoreOutput("gone", [1], step_logprobs=batch).logprobs is None


def test_rows_of_a_step_whose_rows_do_not_all_sample() -> None:
    """A partial prefill samples nothing: the batch names only the rows that sampled."""
    _, tokens, batch = step_batch([2, 2, 2, 2], rows=np.array([1, 3]))
    assert batch.req_ids == ["r1", "r3"] and batch.span("r3") == (1, 2) and batch.span("r0") is None
    m = EngineCoreOutput("r3", [int(tokens[1])], step_logprobs=batch).logprobs
    assert m is not None and m.token_ids[0, 0] == int(tokens[1])


def test_consecutive_rows_of_one_request() -> None:
    ids = np.arange(12, dtype=np.int32).reshape(4, 3)
    batch = LogprobsBatch(
        ids,
        np.zeros((4, 3), np.float32),
        np.array([1, 2, 3, 4], np.int32),
        ["a", "b", "b", "c"],
        np.array([2, 1, 1, 2], np.int32),
    )
    assert [batch.span(r) for r in "abc"] == [(0, 1), (1, 3), (3, 4)]
    m = EngineCoreOutput("b", [4, 7], step_logprobs=batch).logprobs
    assert m is not None and m.token_ids.tolist() == [[3, 4], [6, 7]] and m.ranks.tolist() == [2, 3]
    # A stop inside the step keeps the first rows.
    head = EngineCoreOutput("b", [4], step_logprobs=batch).logprobs
    assert head is not None and len(head) == 1


def test_a_message_pickles_the_steps_batch_once() -> None:
    _, _, batch = step_batch([5] * 64)
    out = ModelRunnerOutput(list(batch.req_ids or []), [[1]] * 64, logprobs=batch)
    buffers: list[pickle.PickleBuffer] = []
    back = pickle.loads(pickle.dumps(out, protocol=5, buffer_callback=buffers.append), buffers=buffers)
    assert len(buffers) <= 4  # out of band, as Ray sends arrays: the batch's four, once
    assert back.logprobs is not None and back.logprobs.req_ids == batch.req_ids
    for name in ("token_ids", "logprobs", "ranks", "ks"):
        assert (getattr(back.logprobs, name) == getattr(batch, name)).all()
    # The driver's outputs of that step (the scheduler's own id strings), as the client polls them.
    outputs = [EngineCoreOutput(f"r{i}", [1]) for i in range(64)] + [EngineCoreOutput("done", [], True)]
    attach_logprobs(outputs, back)
    assert outputs[-1].step_logprobs is None  # no new token: no rows
    buffers.clear()
    polled = pickle.loads(
        pickle.dumps(PollResult(outputs), protocol=5, buffer_callback=buffers.append), buffers=buffers
    ).outputs
    assert len(buffers) <= 4 and len({id(o.step_logprobs) for o in polled[:-1]}) == 1
    for o, want in zip(polled[:-1], outputs[:-1], strict=True):
        got, ref = o.logprobs, want.logprobs
        assert got is not None and ref is not None and (got.token_ids == ref.token_ids).all()


def test_own_arrays() -> None:
    m = Logprobs(
        np.arange(12, dtype=np.int32).reshape(3, 4), np.zeros((3, 4), np.float32), np.array([1, 2, 3], np.int32)
    )
    assert len(m) == 3 and m.token_ids.shape == (3, 4)
    back = pickle.loads(pickle.dumps(m))
    assert len(back) == 3 and back.ranks.tolist() == [1, 2, 3]
