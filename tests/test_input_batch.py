"""InputBatch: rows follow their requests through add / remove / condense / swap."""

import numpy as np
import pytest
import torch

from actors.input_batch import CachedRequestState, InputBatch
from kvcore.request import SamplingParams

MAX_REQS, MAX_LEN, BLOCK_SIZES = 8, 64, [4, 8]


def make_batch() -> InputBatch:
    return InputBatch(MAX_REQS, MAX_LEN, 128, torch.device("cpu"), False, BLOCK_SIZES)


def make_state(i: int, rng: np.random.Generator) -> CachedRequestState:
    prompt = rng.integers(0, 1000, size=int(rng.integers(1, 20))).tolist()
    out = rng.integers(0, 1000, size=int(rng.integers(0, 5))).tolist()
    n = len(prompt) + len(out)
    blocks = tuple(list(range(100 * i + 1, 100 * i + 1 + -(-n // bs))) for bs in BLOCK_SIZES)
    sp = SamplingParams(temperature=0.1 * i, top_p=0.5 + 0.05 * i, top_k=i, seed=i)
    return CachedRequestState(
        f"r{i}", prompt, sp, 1000 + i, blocks, num_computed_tokens=len(prompt) // 2, output_token_ids=out
    )


def row_view(batch: InputBatch, row: int) -> dict:
    """Everything the batch stores for one row, normalised for comparison."""
    n = int(batch.num_tokens[row])
    return dict(
        req_id=batch.index_to_req_id[row],
        tokens=batch.token_ids_cpu[row, :n].tolist(),
        prompt=int(batch.num_prompt_tokens[row]),
        computed=int(batch.num_computed_tokens[row]),
        temp=float(batch.temperature[row]),
        top_p=float(batch.top_p[row]),
        top_k=int(batch.top_k[row]),
        greedy=bool(batch.greedy[row]),
        seed=int(batch.seed[row]),
        blocks=[bt.block_table.np[row, : bt.num_blocks_per_row[row]].tolist() for bt in batch.block_table.block_tables],
        block_tail_zero=all(
            not bt.block_table.np[row, bt.num_blocks_per_row[row] :].any() for bt in batch.block_table.block_tables
        ),
    )


def by_req(batch: InputBatch) -> dict:
    return {rid: row_view(batch, row) for rid, row in batch.req_id_to_index.items()}


def test_add_takes_lowest_free_row():
    rng = np.random.default_rng(0)
    batch = make_batch()
    states = [make_state(i, rng) for i in range(5)]
    assert [batch.add_request(s) for s in states] == [0, 1, 2, 3, 4]
    assert batch.remove_request("r3") == 3
    assert batch.remove_request("r1") == 1
    assert batch.remove_request("nope") is None
    assert batch.add_request(make_state(7, rng)) == 1  # lowest hole first
    assert batch.add_request(make_state(8, rng)) == 3
    assert batch.add_request(make_state(9, rng)) == 5  # no holes left: next row at the top
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(make_state(9, rng))


def test_remove_condense_equals_batch_of_survivors():
    rng = np.random.default_rng(1)
    for trial in range(20):
        batch = make_batch()
        states = [make_state(i, rng) for i in range(MAX_REQS)]
        for s in states:
            batch.add_request(s)
        # Grow some rows as a running request would, then remove a random subset.
        for s in states[::2]:
            row = batch.req_id_to_index[s.req_id]
            batch.append_token(row, 4242)
            s.output_token_ids.append(4242)
            delta = tuple([900 + trial] for _ in BLOCK_SIZES)
            batch.block_table.append_row(delta, row)
            for blocks, d in zip(s.block_ids, delta, strict=True):
                blocks.extend(d)
        removed = set(rng.choice(MAX_REQS, size=int(rng.integers(1, MAX_REQS)), replace=False).tolist())
        for i in removed:
            batch.remove_request(f"r{i}")
        batch.condense()
        survivors = [s for i, s in enumerate(states) if i not in removed]
        assert batch.num_reqs == len(survivors)
        assert sorted(batch.req_id_to_index.values()) == list(range(len(survivors)))  # dense
        fresh = make_batch()
        for s in survivors:
            fresh.add_request(s)
        assert by_req(batch) == by_req(fresh)
        # Rows past the batch hold no stale block ids.
        for bt in batch.block_table.block_tables:
            assert not bt.block_table.np[len(survivors) :].any()
            assert not bt.num_blocks_per_row[len(survivors) :].any()


def test_condense_moves_highest_rows_into_holes():
    rng = np.random.default_rng(2)
    batch = make_batch()
    for i in range(6):
        batch.add_request(make_state(i, rng))
    batch.remove_request("r1")
    batch.remove_request("r2")
    batch.remove_request("r4")
    batch.condense()
    # r5 (row 5) fills hole 1, r3 (row 3) fills hole 2; r0 stays.
    assert batch.req_ids == ["r0", "r5", "r3"]


def test_swap_states():
    rng = np.random.default_rng(3)
    batch = make_batch()
    states = [make_state(i, rng) for i in range(4)]
    for s in states:
        batch.add_request(s)
    before = by_req(batch)
    batch.swap_states(0, 3)
    assert batch.req_id_to_index["r0"] == 3 and batch.req_id_to_index["r3"] == 0
    assert batch.index_to_req_id[0] == "r3" and batch.index_to_req_id[3] == "r0"
    after = by_req(batch)
    for rid in before:
        assert before[rid] == after[rid]
    batch.remove_request("r1")
    with pytest.raises(ValueError, match="both rows must be occupied"):
        batch.swap_states(1, 2)


def test_block_rows_follow_requests_through_commit():
    """After condense + commit, the device block table row of each request is its block list."""
    rng = np.random.default_rng(4)
    batch = make_batch()
    states = [make_state(i, rng) for i in range(6)]
    for s in states:
        batch.add_request(s)
    batch.block_table.commit_block_table(batch.num_reqs)
    for rid in ("r0", "r2"):
        batch.remove_request(rid)
    batch.condense()
    batch.block_table.commit_block_table(batch.num_reqs)
    for s in states:
        if s.req_id in ("r0", "r2"):
            continue
        row = batch.req_id_to_index[s.req_id]
        for gid, blocks in enumerate(s.block_ids):
            dev = batch.block_table[gid].block_table.gpu[row, : len(blocks)].tolist()
            assert dev == blocks


def test_append_token_and_limits():
    batch = make_batch()
    sp = SamplingParams()
    state = CachedRequestState("a", list(range(MAX_LEN - 1)), sp, 0, ([1] * 16, [1] * 8), 0)
    row = batch.add_request(state)
    batch.append_token(row, 7)
    assert batch.num_tokens[row] == MAX_LEN and batch.token_ids_cpu[row, -1] == 7
    batch.append_token(row, 8)  # beyond max_model_len: not stored, never fed back
    assert batch.num_tokens[row] == MAX_LEN
    too_long = CachedRequestState("b", list(range(MAX_LEN + 1)), sp, 0, ([], []), 0)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add_request(too_long)
    for i in range(MAX_REQS - 1):
        batch.add_request(CachedRequestState(f"x{i}", [1], sp, 0, ([1], [1]), 0))
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request(CachedRequestState("y", [1], sp, 0, ([1], [1]), 0))


def test_the_warm_up_samples_through_the_views_real_steps_use():
    """Triton compiles a variant per argument dtype and alignment: the warm-up's metadata must be the
    very views build() hands the sampler, or the first real steps compile their own."""
    from actors.sample.inputs import SamplingInputs

    batch, rng = make_batch(), np.random.default_rng(0)
    rows = np.array([batch.add_request(make_state(i, rng)) for i in range(1, 6)])
    si = SamplingInputs(MAX_REQS, torch.device("cpu"), False)
    real = si.build(batch, rows, np.zeros(len(rows), dtype=np.int64))
    for filters in (False, True):
        warm = si.dummy(len(rows), filters)
        assert warm.need_filter is filters and not warm.all_greedy
        for name in ("temperature", "top_k", "top_p", "seeds", "positions"):
            a, b = getattr(real, name), getattr(warm, name)
            assert (a.dtype, a.shape, a.stride(), a.data_ptr()) == (b.dtype, b.shape, b.stride(), b.data_ptr()), name
    assert torch.equal(warm.top_k, torch.full((5,), 8)) and torch.allclose(warm.top_p, torch.full((5,), 0.9))
