"""The one-launch sampler: the Triton kernel (run by the interpreter) against its torch reference and
the Philox stream; seeded tokens independent of the batch and of a restart; sampled frequencies against
the target distribution (chi-square, fixed seeds); greedy rows; penalties against vLLM's formulas;
the min_tokens ban; the device-side penalty counts."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from actors.sample.kernel import launch_sample
from actors.sample.kernel_ops import philox_uniform_triton
from actors.sample.penalties import PenaltyState
from actors.sample.reference import philox_uniform, sample_reference, top_k_top_p_mask
from actors.sample.sampler import Sampler, SamplingMetadata, request_seed

V = 48


def _rows(n, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    temp = torch.rand(n, generator=g) + 0.3
    top_k = torch.randint(0, 12, (n,), generator=g, dtype=torch.int32)
    top_p = torch.rand(n, generator=g) * 0.9 + 0.1
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g)
    pos = torch.randint(0, 5000, (n,), generator=g)
    return logits, temp, top_k, top_p, seeds, pos


def _penalty_inputs(n, vocab=V, seed=1):
    g = torch.Generator().manual_seed(seed)
    state = PenaltyState(vocab, torch.device("cpu"), initial_slots=2)
    slots = []
    for i in range(n):
        if i % 3 == 2:
            slots.append(-1)
            continue
        prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
        out = torch.randint(0, vocab, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
        slots.append(state.add(f"r{i}", prompt, out))
    pen = torch.stack(
        [torch.rand(n, generator=g) * 4 - 2, torch.rand(n, generator=g) * 4 - 2, torch.rand(n, generator=g) * 1.5 + 0.5]
    )
    return state, torch.tensor(slots), pen


@pytest.mark.parametrize("vocab", [300, 301])
def test_philox_uniforms_match_torch_bit_for_bit(vocab):
    seeds = torch.tensor([0, 1, -5, 2**62 + 3, -(2**63)])
    pos = torch.tensor([0, 7, 123456, 2**31 + 5, 2**32 - 1])
    u = philox_uniform_triton(seeds, pos, vocab)
    assert torch.equal(u, philox_uniform(seeds, pos, vocab))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Four entries share a Philox evaluation but never a value (its four lanes differ).
    quads = u[:, :300].reshape(5, 75, 4)
    assert bool((quads[..., 0] != quads[..., 1]).all()) and bool((quads[..., 2] != quads[..., 3]).all())


@pytest.mark.parametrize("need_filter", [False, True])
def test_kernel_matches_reference(need_filter):
    n = 12
    logits, temp, top_k, top_p, seeds, pos = _rows(n)
    temp[[0, 5]] = 0.0  # greedy rows in the batch
    if not need_filter:
        top_k, top_p = torch.zeros_like(top_k), torch.ones_like(top_p)
    state, slots, pen = _penalty_inputs(n)
    ban = torch.full((n, 2), -1, dtype=torch.int32)
    ban[1] = torch.tensor([int(logits[1].argmax()), 3])
    ban[5, 0] = int(logits[5].argmax())
    kw = dict(penalty_slots=slots, penalties=pen, counts=state.counts, prompt_mask=state.prompt_mask, ban_ids=ban)
    ref = sample_reference(logits, temp, top_k, top_p, seeds, pos, **kw)
    # One program of all rows and one tile (cheap under the interpreter), and several tiles of 16.
    for block_v in [V, 16] if not need_filter else [V]:
        out = launch_sample(
            logits, temp, top_k, top_p, seeds, pos, need_filter=need_filter, rows_per_program=n, block_v=block_v, **kw
        )
        assert out.tolist() == ref.tolist(), block_v
    plain = launch_sample(logits, temp, top_k, top_p, seeds, pos, need_filter=need_filter, rows_per_program=n)
    assert plain.tolist() == sample_reference(logits, temp, top_k, top_p, seeds, pos).tolist()
    assert int(out[5]) != int(logits[5].argmax())  # a greedy row never takes a banned token


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_vocabulary_shares_merge_like_one_pass(monkeypatch, rows_per_program):
    """A row split over programs by vocabulary share gives the one-pass token: greedy ties across shares
    go to the first index, the race's winner is the reference's, and the shares' done-counts end at zero
    (so the next launch merges again)."""
    import actors.sample.kernel as sk

    n = 6
    vocab = 96  # 6 tiles of 16: 2 or 6 shares
    logits, temp, _, _, seeds, pos = _rows(n, vocab=vocab)
    temp[[0, 3]] = 0.0
    logits[0, 5] = logits[0, vocab - 3] = logits[0].max() + 1  # a greedy tie in the first and the last share
    zeros_k, ones_p = torch.zeros(n, dtype=torch.int32), torch.ones(n)
    ref = sample_reference(logits, temp, zeros_k, ones_p, seeds, pos)
    for shares in (2, 6):
        monkeypatch.setattr(sk, "vocab_shares", lambda blocks, tiles, device, s=shares: s)
        for _ in range(2):
            out = sk.launch_sample(
                logits,
                temp,
                zeros_k,
                ones_p,
                seeds,
                pos,
                need_filter=False,
                rows_per_program=rows_per_program,
                block_v=16,
            )
            assert out.tolist() == ref.tolist(), shares
            assert int(out[0]) == 5
            assert int(sk._COUNTS[logits.device].abs().sum()) == 0


def test_greedy_rows_are_argmax():
    logits, *_ = _rows(6)
    greedy = SamplingMetadata(None, None, None, None, None, all_greedy=True, need_filter=False)
    assert torch.equal(Sampler()(logits, greedy).token_ids, logits.argmax(-1))
    # Mixed with random rows (the kernel path), greedy rows keep their argmax; ties pick the first index.
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1
    temp = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    md = SamplingMetadata(
        temp,
        torch.zeros(6, dtype=torch.int32),
        torch.ones(6),
        torch.arange(6),
        torch.zeros(6, dtype=torch.int64),
        all_greedy=False,
        need_filter=False,
    )
    out = Sampler(use_triton=True)(logits, md).token_ids
    assert out[[0, 2, 4]].tolist() == logits.argmax(-1)[[0, 2, 4]].tolist() and int(out[0]) == 3


@pytest.mark.parametrize("shares", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_kernel_is_torch_argmax(monkeypatch, shares, dtype):
    """The plain-greedy kernel (the vocabulary split over programs, no draw) names torch.argmax's token on
    every row, the first index on a tie across shares, and leaves the shares' done-counts at zero; the
    sampler takes it for an all-greedy batch where the kernels run."""
    import actors.sample.kernel as sk

    n, vocab = 5, 130  # 9 tiles of 16, the last one short: 1, 3 or 5 shares
    logits, *_ = _rows(n, vocab=vocab)
    logits = logits.to(dtype)
    logits[1, 2] = logits[1, vocab - 1] = logits[1].max() + 1  # tie: first and last share
    logits[3, 64:] = logits[3].max() + 2  # many equal maxima, from the middle on
    monkeypatch.setattr(sk, "vocab_shares", lambda blocks, tiles, device: shares)
    for rows_per_program in (1, 4):
        for _ in range(2):  # the second launch merges again: the counts were reset
            got = sk.greedy_argmax(logits, rows_per_program, block_v=16)
            assert got.tolist() == logits.argmax(-1).tolist(), (shares, rows_per_program)
            assert got.tolist()[1] == 2 and got.tolist()[3] == 64
            assert int(sk._COUNTS[logits.device].abs().sum()) == 0
    greedy = SamplingMetadata(None, None, None, None, None, all_greedy=True, need_filter=False)
    calls = []
    monkeypatch.setattr("actors.sample.sampler.greedy_argmax", lambda x, r: calls.append(r) or sk.greedy_argmax(x, r))
    assert Sampler(use_triton=True)(logits, greedy).token_ids.tolist() == logits.argmax(-1).tolist()
    assert calls == [16], "the sampler's all-greedy batch did not take the kernel"


def _draw(logits_row, seed, positions, temp, top_k=0, top_p=1.0, **kw):
    n = len(positions)
    return launch_sample(
        logits_row.expand(n, -1).contiguous(),
        torch.full((n,), temp),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), top_p),
        torch.full((n,), seed, dtype=torch.int64),
        torch.tensor(list(positions), dtype=torch.int64),
        need_filter=top_k > 0 or top_p < 1,
        rows_per_program=n,
        **kw,
    )


def test_seeded_tokens_do_not_depend_on_the_batch():
    """One request's 16 positions, alone and scattered among other rows in two shuffled batches."""
    logits, temp, top_k, top_p, seeds, pos = _rows(24, seed=3)
    target, steps = 4, 16
    temp[target], top_k[target], top_p[target] = 2.0, 0, 0.95

    def rep(t):
        return t[target : target + 1].expand(steps, *t.shape[1:])

    positions = torch.arange(steps)

    def alone(seed):
        return launch_sample(
            rep(logits).contiguous(),
            rep(temp),
            rep(top_k),
            rep(top_p),
            torch.full((steps,), seed),
            positions,
            need_filter=True,
            rows_per_program=steps,
        )

    want = alone(int(seeds[target])).tolist()
    for perm_seed in range(2):
        cols = [torch.cat([rep(t), t]) for t in (logits, temp, top_k, top_p, seeds)]
        cols.append(torch.cat([positions, pos]))
        perm = torch.randperm(steps + 24, generator=torch.Generator().manual_seed(perm_seed))
        out = launch_sample(*(c[perm].contiguous() for c in cols), need_filter=True, rows_per_program=64)
        inv = torch.argsort(perm)
        assert out[inv[:steps]].tolist() == want
    assert len(set(want)) > 2 and alone(int(seeds[target]) + 1).tolist() != want


def test_seeded_tokens_survive_a_restart():
    """A fresh process (no interpreter: the plain-CPU path, the torch reference) draws the same tokens."""
    logits, temp, top_k, top_p, seeds, pos = _rows(4, seed=5)
    here = launch_sample(logits, temp, top_k, top_p, seeds, pos, need_filter=True, rows_per_program=4)
    code = (
        "import torch,sys; from actors.sample.reference import sample_reference as s; "
        "a=torch.load(sys.argv[1]); print(s(*a).tolist())"
    )
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sampler-restart-{os.getpid()}.pt")
    torch.save((logits, temp, top_k, top_p, seeds, pos), path)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.getcwd()}
    try:
        res = subprocess.run(
            [sys.executable, "-c", code, path], capture_output=True, text=True, env=env, timeout=120, check=True
        )
    finally:
        os.unlink(path)
    assert res.stdout.strip() == str(here.tolist())


def test_unseeded_requests_derive_from_engine_seed_and_req_id():
    a = request_seed(None, 0, "req-a")
    assert a == request_seed(None, 0, "req-a")  # what every rank and every restart derives
    assert a != request_seed(None, 0, "req-b") and a != request_seed(None, 1, "req-a")
    assert request_seed(7, 0, "x") == 7 == request_seed(7, 3, "y")
    assert request_seed(2**64 - 1, 0, "x") == -1  # any int maps onto a 64-bit key


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a token outside the support was sampled"
    exp = probs[kept] * counts.sum()
    return float(((counts[kept] - exp) ** 2 / exp).sum()), int(kept.sum()) - 1


# Upper 0.1% points of chi-square (df 1..8): the draws are fixed by the seeds, so this is not flaky.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


@pytest.mark.parametrize(
    "temp,top_k,top_p,penalised",
    [(0.7, 0, 1.0, False), (1.3, 5, 1.0, False), (1.0, 0, 0.8, False), (1.1, 6, 0.9, True)],
)
def test_sampled_frequencies_match_the_target(temp, top_k, top_p, penalised):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8, 0.3]])
    vocab, n = logits.shape[1], 6000
    kw, x = {}, logits.clone()
    if penalised:
        state = PenaltyState(vocab, torch.device("cpu"))
        slot = state.add("r", [0, 3], [1, 1, 4])
        kw = dict(
            penalty_slots=torch.full((n,), slot),
            penalties=torch.tensor([[0.4], [0.3], [1.5]]).expand(3, n),
            counts=state.counts,
            prompt_mask=state.prompt_mask,
        )
        # vLLM's formulas by hand: token 0 and 3 in the prompt, 1 twice and 4 once in the output.
        x = torch.tensor(
            [[2.0 / 1.5, 1.5 / 1.5 - 0.3 * 2 - 0.4, 1.0, 0.5 / 1.5, 0.0 * 1.5 - 0.3 - 0.4, -0.5, -1.0, 0.8, 0.3]]
        )
    tokens = _draw(logits[0], 1234, range(n), temp, top_k, top_p, **kw)
    y = x / temp
    keep = top_k_top_p_mask(y, torch.tensor([top_k]), torch.tensor([top_p]))
    probs = torch.where(keep, y, float("-inf")).softmax(-1)[0].numpy()
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    stat, df = _chi_square(counts, probs)
    assert stat < CHI2_999[df], (stat, df, counts / n, probs)


def test_top_k_top_p_threshold_semantics():
    y = torch.tensor([[3.0, 1.0, 1.0, 0.5, -1.0, 2.0]])
    # top-k keeps ties at the k-th value (as vLLM's top-k does).
    keep = top_k_top_p_mask(y, torch.tensor([3]), torch.tensor([1.0]))
    assert keep[0].tolist() == [True, True, True, False, False, True]
    # top-p keeps the smallest prefix reaching p; the first token always.
    p = y.softmax(-1)[0]
    keep = top_k_top_p_mask(y, torch.tensor([0]), torch.tensor([float(p[0] + p[5]) - 1e-3]))
    assert keep[0].tolist() == [True, False, False, False, False, True]
    keep = top_k_top_p_mask(y, torch.tensor([0]), torch.tensor([0.01]))
    assert keep[0].tolist() == [True, False, False, False, False, False]


def vllm_penalties(logits, prompt_tokens, output_tokens, presence, frequency, repetition):
    """vLLM's apply_penalties, as written there (bin counts from padded token lists)."""
    num_seqs, vocab = logits.shape

    def bins(tokens):
        counts = torch.zeros(num_seqs, vocab + 1, dtype=torch.long)
        counts.scatter_add_(1, tokens, torch.ones_like(tokens))
        counts = counts[:, :vocab]
        return counts, counts > 0

    _, prompt_mask = bins(prompt_tokens)
    output_bin_counts, output_mask = bins(output_tokens)
    penalties = torch.where(prompt_mask | output_mask, repetition.unsqueeze(1).repeat(1, vocab), 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    logits = logits - frequency.unsqueeze(1) * output_bin_counts
    return logits - presence.unsqueeze(1) * output_mask


@pytest.mark.parametrize("use_triton", [True, False], ids=["kernel", "reference"])
def test_penalties_match_vllm_formulas_and_counts_grow_on_device(use_triton):
    n, vocab = 6, V
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(n, vocab, generator=g) * 2
    state = PenaltyState(vocab, torch.device("cpu"), initial_slots=2)  # grows while adding
    prompts = [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(n)]
    outputs = [[] for _ in range(n)]
    slots = torch.tensor([state.add(f"r{i}", prompts[i], []) for i in range(n)])
    pen = torch.stack(
        [torch.rand(n, generator=g) * 4 - 2, torch.rand(n, generator=g) * 4 - 2, torch.rand(n, generator=g) * 1.5 + 0.5]
    )
    sampler = Sampler(state, use_triton=use_triton)
    for step in range(6):
        md = SamplingMetadata(
            torch.zeros(n),
            torch.zeros(n, dtype=torch.int32),
            torch.ones(n),
            torch.zeros(n, dtype=torch.int64),
            torch.full((n,), step),
            all_greedy=True,
            need_filter=False,
            penalty_slots=slots,
            penalties=pen,
        )
        tokens = sampler(logits, md).token_ids

        def pad(rows):
            return torch.tensor([r + [vocab] * (10 - len(r)) for r in rows])

        want = vllm_penalties(logits, pad(prompts), pad(outputs), pen[0], pen[1], pen[2]).argmax(-1)
        assert tokens.tolist() == want.tolist(), step
        for i, t in enumerate(tokens.tolist()):
            outputs[i].append(t)
        for i in range(n):  # the device counts equal the output histogram
            assert state.counts[slots[i]].tolist() == np.bincount(outputs[i], minlength=vocab).tolist()
    assert len(set(map(tuple, outputs))) > 1 and any(len(set(o)) > 1 for o in outputs)
    state.remove("r0")
    assert state.add("new", [1], []) == int(slots[0]) and int(state.counts[slots[0]].sum()) == 0


def test_ties_at_the_cut_off_are_all_kept_by_kernel_and_reference():
    """Ten tokens tie at the top: top-k 3 and top-p 0.2 both keep all ten (the bisection's early stop
    must land on the same set as the sort), and the draws spread over exactly them."""
    row = torch.full((V,), -2.0)
    row[5:15] = 1.0
    row[20] = 0.5
    n = 64
    for top_k, top_p in ((3, 1.0), (0, 0.2), (11, 0.99)):
        tokens = _draw(row, 99, range(n), 1.0, top_k, top_p)
        want = sample_reference(
            row.expand(n, -1),
            torch.ones(n),
            torch.full((n,), top_k, dtype=torch.int32),
            torch.full((n,), top_p),
            torch.full((n,), 99),
            torch.arange(n),
        )
        assert tokens.tolist() == want.tolist()
        assert set(tokens.tolist()) <= set(range(5, 15)) | ({20} if top_k == 11 else set())
        assert len(set(tokens.tolist()) & set(range(5, 15))) > 5


def _logit_rows(n, vocab=V, seed=2):
    """LogitRows for some rows: allowed_token_ids, logit_bias and one-token bad words (vLLM's order: masked
    ids stay -inf whatever their bias)."""
    from actors.sample.logit_rows import LogitRows
    from kvcore.request import SamplingParams

    g = torch.Generator().manual_seed(seed)
    state = LogitRows(vocab, torch.device("cpu"), initial_slots=1)
    slots = []
    for i in range(n):
        if i % 4 == 3:
            slots.append(-1)
            continue
        ids = torch.randperm(vocab, generator=g).tolist()
        sp = SamplingParams(
            allowed_token_ids=ids[:20] if i % 2 else None,
            logit_bias={t: float(torch.rand(1, generator=g)) * 8 - 4 for t in ids[10:16]},
            bad_words_token_ids=[[ids[0]], [ids[11], ids[12]]],  # the second is a per-step ban, not a row
        )
        slots.append(state.add(f"r{i}", sp))
    return state, torch.tensor(slots)


@pytest.mark.parametrize("need_filter", [False, True])
def test_logit_rows_bans_after_a_token_and_min_p_match_reference(need_filter):
    """logit_bias / allowed_token_ids rows, bans conditional on the last token (bad words) and min_p: the
    kernel against the reference, with penalties and greedy rows in the batch."""
    n = 12
    logits, temp, top_k, top_p, seeds, pos = _rows(n, seed=3)
    temp[[0, 6]] = 0.0
    if not need_filter:
        top_k, top_p = torch.zeros_like(top_k), torch.ones_like(top_p)
    state, slots, pen = _penalty_inputs(n)
    rows, lslots = _logit_rows(n)
    g = torch.Generator().manual_seed(4)
    last = torch.randint(0, V, (n,), generator=g)
    ban = torch.randint(0, V, (n, 3), generator=g, dtype=torch.int32)
    prev = torch.full((n, 3), -1, dtype=torch.int32)
    prev[:, 1] = last.to(torch.int32)  # met: banned
    prev[:, 2] = ((last + 1) % V).to(torch.int32)  # not met: not banned
    ban[0, 1] = int(logits[0].argmax())  # the greedy row's argmax banned after its last token
    ban[3, 2] = int(logits[3].argmax())  # ... and one not banned
    min_p = torch.rand(n, generator=g) * 0.5 if need_filter else None
    if min_p is not None:
        min_p[[2, 7]] = 0.0
    kw = dict(
        penalty_slots=slots,
        penalties=pen,
        counts=state.counts,
        prompt_mask=state.prompt_mask,
        ban_ids=ban,
        ban_prev=prev,
        last_tokens=last,
        logit_rows=rows.rows,
        logit_slots=lslots,
        min_p=min_p,
    )
    ref = sample_reference(logits, temp, top_k, top_p, seeds, pos, **kw)
    for block_v in [V, 16]:
        out = launch_sample(
            logits, temp, top_k, top_p, seeds, pos, need_filter=need_filter, rows_per_program=n, block_v=block_v, **kw
        )
        assert out.tolist() == ref.tolist(), block_v
    # What the reference does is what vLLM does: the sampled token is allowed, never banned.
    for i in range(n):
        if int(lslots[i]) >= 0:
            assert float(rows.rows[lslots[i], out[i]]) > float("-inf")
        assert int(out[i]) != int(ban[i, 1])
    assert int(out[0]) != int(logits[0].argmax())
    # Without the bans whose condition fails, the same tokens: they were not applied.
    kw["ban_ids"], kw["ban_prev"] = ban[:, :2].contiguous(), prev[:, :2].contiguous()
    assert sample_reference(logits, temp, top_k, top_p, seeds, pos, **kw).tolist() == ref.tolist()


def test_logit_rows_hold_vllms_meanings():
    from actors.sample.logit_rows import LogitRows
    from kvcore.request import SamplingParams

    state = LogitRows(10, torch.device("cpu"), initial_slots=1)
    assert state.add("plain", SamplingParams(min_p=0.5)) == -1  # nothing vocabulary-wide: no slot
    a = state.add("a", SamplingParams(allowed_token_ids=[1, 4, 5], logit_bias={4: 2.5, 7: 9.0}))
    b = state.add("b", SamplingParams(logit_bias={"3": -1.5}, bad_words_token_ids=[[6], [2, 9]]))
    inf = float("inf")
    assert state.rows[a].tolist() == [-inf, 0, -inf, -inf, 2.5, 0, -inf, -inf, -inf, -inf]
    assert state.rows[b].tolist() == [0, 0, 0, -1.5, 0, 0, -inf, 0, 0, 0]
    state.remove("a")
    assert state.add("c", SamplingParams(logit_bias={0: 1.0})) == a  # the slot is reused, rebuilt
    assert state.rows[a].tolist() == [1.0] + [0.0] * 9
    state.clear()  # the runner's reset: every slot free again, lowest first
    assert "b" not in state and state.add("d", SamplingParams(allowed_token_ids=[2])) == 0


def test_min_p_keeps_tokens_within_min_p_of_the_top_probability():
    g = torch.Generator().manual_seed(5)
    y = torch.randn(6, V, generator=g) * 2
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.5, 1.0, 0.9])
    keep = top_k_top_p_mask(y, torch.zeros(6, dtype=torch.int32), torch.ones(6), min_p)
    probs = y.softmax(-1)
    want = probs >= min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values  # vLLM's formula
    assert torch.equal(keep, want)
    assert bool(keep[0].all()) and int(keep[4].sum()) == 1


def test_bad_word_bans_follow_the_output_tail():
    """A bad word [a, b, c] bans c only when the output ends with a, b: the host checks a against the
    output it has, the kernel checks b against the last token (which async scheduling keeps on the
    device). Output tokens only: a prompt ending in a, b bans nothing."""
    from actors.input_batch import CachedRequestState, InputBatch
    from actors.sample.inputs import SamplingInputs
    from kvcore.request import SamplingParams

    batch = InputBatch(4, 32, 64, torch.device("cpu"), False, [16])
    words = [[7, 8, 9], [3, 4], [5]]
    for i, out in enumerate([[1, 7, 8], [7], [], [2, 7]]):
        sp = SamplingParams(temperature=1.0, bad_words_token_ids=words)
        batch.add_request(CachedRequestState(f"r{i}", [7, 8], sp, 0, ([1],), 2 + len(out), list(out)))
    rows = np.arange(4)
    # Row 3's last output token (8) is in flight: the host has [2, 7] but samples output position 3.
    positions = np.array([3, 1, 0, 3])
    ids = torch.tensor([0, 8, 0, 7, 0, 8, 0, 8])  # the step's input ids; each row's last token below
    idx = torch.tensor([1, 3, 5, 7])
    md = SamplingInputs(4, torch.device("cpu"), False).build(batch, rows, positions, (ids, idx))
    assert md.ban_ids is not None and md.ban_prev is not None and md.logit_slots is None
    bans = {
        j: sorted((int(b), int(p)) for b, p in zip(md.ban_ids[j], md.ban_prev[j], strict=True) if b >= 0)
        for j in range(4)
    }
    # Row 0: [.., 7, 8] matches [7, 8] before 9 (its last token, 8, still checked on the device); and
    # [3, 4] waits for a last token 3. Row 1: one output token, too short for [7, 8, 9]. Row 2: no output
    # (the prompt's 7, 8 do not count). Row 3: the host knows 7 at position 1, the kernel checks 8.
    assert bans == {0: [(4, 3), (9, 8)], 1: [(4, 3)], 2: [], 3: [(4, 3), (9, 8)]}
    logits = torch.zeros(4, 12)
    logits[:, 9] = logits[:, 4] = 5.0
    logits[:, 9] += 1.0
    md.temperature.zero_()  # greedy: the argmax of what is left
    tokens = Sampler(use_triton=False)(logits, md).token_ids.tolist()
    assert tokens == [4, 9, 9, 4]  # rows 0 and 3 end with 7, 8: 9 banned; nobody ends with 3
