"""A step's logprob messages: each request's Logprobs is a window of the step's one batch, the rows equal
the step's computed rows trimmed to the request's k, and a message pickles the batch once (three arrays a
step, not three per request), as the worker -> driver -> client path sends it."""
from __future__ import annotations

import pickle

import numpy as np
import torch

from actors.logprobs import compute_logprobs
from actors.step_logprobs import LogprobsCollector, launch_copies
from kvcore.messages import EngineCoreOutput, Logprobs, ModelRunnerOutput


def step_messages(ks: list[int]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Logprobs]]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ks), 300, generator=g)
    tokens = torch.randint(0, 300, (len(ks),), generator=g)
    lp = compute_logprobs(logits, tokens, max(ks))
    step = launch_copies(lp, np.array(ks, dtype=np.int32), None, None, cuda=False)
    rows = np.arange(len(ks))
    sampled, prompt = LogprobsCollector().collect(step, [f"r{i}" for i in range(len(ks))], rows)
    assert prompt is None and sampled is not None
    return logits, tokens, sampled


def test_windows_hold_each_requests_rows_trimmed_to_its_k() -> None:
    ks = [5, -1, 0, 3, 5]
    logits, tokens, sampled = step_messages(ks)
    assert sorted(sampled) == ["r0", "r2", "r3", "r4"]  # k = -1 asked for none
    lp = logits.log_softmax(-1)
    for i, k in enumerate(ks):
        if k < 0:
            continue
        m = sampled[f"r{i}"]
        assert len(m) == 1 and m.token_ids.shape == (1, 1 + k) == m.logprobs.shape and m.ranks.shape == (1,)
        tok = int(tokens[i])
        assert m.token_ids[0, 0] == tok and abs(float(m.logprobs[0, 0]) - float(lp[i, tok])) < 1e-5
        assert int(m.ranks[0]) == int((lp[i] >= lp[i, tok]).sum())
        assert m.token_ids[0, 1:].tolist() == lp[i].topk(k).indices.tolist()
        ids, lps, ranks = m.row_lists()
        assert ids[0][:1 + k] == m.token_ids[0].tolist() and lps[0][:1 + k] == m.logprobs[0].tolist()
        assert ranks == m.ranks.tolist()


def test_a_message_pickles_the_steps_batch_once() -> None:
    _, _, sampled = step_messages([5] * 64)
    out = ModelRunnerOutput(list(sampled), [[1]] * 64, logprobs=sampled)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(out, protocol=5, buffer_callback=buffers.append)
    back = pickle.loads(data, buffers=buffers)
    assert len(buffers) <= 3  # out of band, as Ray sends arrays: the batch's three, once
    assert back.logprobs is not None
    assert len({id(m.batch) for m in back.logprobs.values()}) == 1
    for rid, m in sampled.items():
        got = back.logprobs[rid]
        assert (got.token_ids == m.token_ids).all() and (got.logprobs == m.logprobs).all()
        assert (got.ranks == m.ranks).all()
    # The driver's outputs of that step, as the client polls them: the batch still goes once.
    outputs = [EngineCoreOutput(rid, [1], logprobs=m) for rid, m in back.logprobs.items()]
    buffers.clear()
    polled = pickle.loads(pickle.dumps(outputs, protocol=5, buffer_callback=buffers.append), buffers=buffers)
    assert len(buffers) <= 3 and len({id(o.logprobs.batch) for o in polled}) == 1


def test_own_arrays_and_head() -> None:
    m = Logprobs(np.arange(12, dtype=np.int32).reshape(3, 4), np.zeros((3, 4), np.float32),
                 np.array([1, 2, 3], np.int32))
    assert len(m) == 3 and m.token_ids.shape == (3, 4)
    h = m.head(2)
    assert len(h) == 2 and h.token_ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and h.ranks.tolist() == [1, 2]
    assert len(pickle.loads(pickle.dumps(h))) == 2
