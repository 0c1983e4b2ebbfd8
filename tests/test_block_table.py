"""BlockTable / MultiGroupBlockTable: row operations, both commit modes, and the slot mapping from
the Triton kernel (run by the interpreter on CPU tensors), checked against a plain Python model."""

import random

import numpy as np
import pytest
import torch

import kvcore.kernels.slot_mapping as sm
from kvcore.block_table import BlockTable, MultiGroupBlockTable
from kvcore.kernels.slot_mapping import TOKEN_TILE, slot_mapping_ref

CPU = torch.device("cpu")
# "delta_only": delta commits with the full-copy fallback off, so that tiny tables still take the
# delta path on every commit.
MODES = ["full", "delta", "delta_only"]


def make_table(mode, block_size=16, max_reqs=8, max_blocks=12, max_tokens=128):
    bt = BlockTable(
        block_size,
        max_reqs,
        max_blocks,
        max_tokens,
        pin_memory=True,
        device=CPU,
        commit_mode="full" if mode == "full" else "delta",
    )
    bt.full_copy_fallback = mode != "delta_only"
    assert bt.use_triton, "the interpreter must run the Triton kernel in these tests"
    return bt


def batch(seqs, pad_to=0):
    """seqs: list of position lists, one per row -> (query_start_loc int32, positions int64). pad_to:
    the step's length with padding (a CUDA-graph bucket), whose entries past the tokens must get -1."""
    qsl = [0]
    for s in seqs:
        qsl.append(qsl[-1] + len(s))
    pos = [p for s in seqs for p in s]
    pos += [0] * max(0, pad_to - len(pos))
    return (torch.tensor(qsl, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64))


def expected_slots(rows, seqs, block_size, buffer_len):
    out = [rows[r][p // block_size] * block_size + p % block_size for r, s in enumerate(seqs) for p in s]
    return out + [-1] * (buffer_len - len(out))


def row_list(bt, r):
    return bt.block_table.np[r, : bt.num_blocks_per_row[r]].tolist()


def assert_zero_tails(bt):
    for r in range(bt.max_num_reqs):
        assert not bt.block_table.np[r, bt.num_blocks_per_row[r] :].any(), f"stale ids in row {r}"


@pytest.mark.parametrize("mode", MODES)
def test_worked_example(mode):
    bt = make_table(mode)
    bt.add_row([10, 25], 0)
    bt.commit_block_table(1)
    qsl, pos = batch([[17]], pad_to=4)
    bt.compute_slot_mapping(1, qsl, pos)
    assert bt.slot_mapping.gpu[0].item() == 401  # block 25 * 16 + 1
    assert bt.slot_mapping.gpu.dtype == torch.int64
    assert (bt.slot_mapping.gpu[1:4] == -1).all()


@pytest.mark.parametrize("mode", MODES)
def test_append_keeps_old_blocks_add_overwrites(mode):
    bt = make_table(mode)
    bt.append_row([3, 4], 1)
    bt.append_row([9], 1)
    assert row_list(bt, 1) == [3, 4, 9]
    assert bt.num_blocks_per_row[1] == 3
    bt.append_row([], 1)
    assert row_list(bt, 1) == [3, 4, 9]
    bt.add_row([7], 1)
    assert row_list(bt, 1) == [7]
    assert_zero_tails(bt)
    bt.commit_block_table(2)
    assert torch.equal(bt.block_table.gpu[:2], bt.block_table.cpu[:2])


@pytest.mark.parametrize("mode", MODES)
def test_move_swap_clear(mode):
    bt = make_table(mode)
    bt.add_row([1, 2, 3], 0)
    bt.add_row([4, 5], 1)
    bt.add_row([6, 7, 8, 9], 2)
    bt.swap_row(0, 1)
    assert (row_list(bt, 0), row_list(bt, 1)) == ([4, 5], [1, 2, 3])
    bt.move_row(0, 2)  # a shorter row over a longer one: the longer one's tail must go
    assert row_list(bt, 2) == [4, 5]
    assert row_list(bt, 0) == [4, 5]  # the source keeps its blocks
    bt.clear_row(1)
    assert row_list(bt, 1) == []
    bt.swap_row(3, 3)
    bt.move_row(2, 2)
    assert_zero_tails(bt)
    bt.commit_block_table(4)
    assert torch.equal(bt.block_table.gpu, bt.block_table.cpu)
    qsl, pos = batch([[0, 31], [], [16], []])
    bt.compute_slot_mapping(4, qsl, pos)
    assert bt.slot_mapping.gpu[:4].tolist() == [64, 95, 80, -1]


@pytest.mark.parametrize("mode", MODES)
def test_padding_is_minus_one_after_a_longer_step(mode):
    bt = make_table(mode, max_tokens=300)  # two tiles of the kernel
    bt.add_row(list(range(1, 13)), 0)
    bt.commit_block_table(1)
    qsl, pos = batch([list(range(180))])
    bt.compute_slot_mapping(1, qsl, pos)
    assert bt.slot_mapping.gpu[179].item() == 12 * 16 + 3
    # A 1-token step padded to 264 entries (across the tile boundary): the longer step's slots there
    # must become -1; past the step's entries nothing is written (no step reads there).
    before = bt.slot_mapping.gpu.clone()
    qsl, pos = batch([[5]], pad_to=264)
    bt.compute_slot_mapping(1, qsl, pos)
    assert bt.slot_mapping.gpu[0].item() == 16 + 5
    assert (bt.slot_mapping.gpu[1:264] == -1).all()
    assert torch.equal(bt.slot_mapping.gpu[264:], before[264:])


@pytest.mark.parametrize("mode", MODES)
def test_request_longer_than_one_tile(mode):
    n = 2 * TOKEN_TILE + 37
    bt = make_table(mode, block_size=16, max_reqs=4, max_blocks=64, max_tokens=n + 100)
    rows = [list(range(100, 100 + 64)), [3, 1, 2]]
    for r, ids in enumerate(rows):
        bt.add_row(ids, r)
    bt.commit_block_table(2)
    seqs = [list(range(n)), [40, 41]]  # the short request sits after the tile boundary
    qsl, pos = batch(seqs, pad_to=n + 100)
    bt.compute_slot_mapping(2, qsl, pos)
    assert bt.slot_mapping.gpu.tolist() == expected_slots(rows, seqs, 16, n + 100)


@pytest.mark.parametrize("mode", MODES)
def test_reused_row_leaves_no_stale_ids(mode):
    bt = make_table(mode)
    bt.add_row(list(range(1, 11)), 0)
    bt.commit_block_table(1)
    bt.clear_row(0)
    bt.add_row([42, 43], 0)
    bt.commit_block_table(1)
    assert bt.block_table.gpu[0].tolist() == [42, 43] + [0] * 10
    bt.add_row(list(range(1, 11)), 1)
    bt.add_row([5], 0)  # overwrite without clear
    bt.move_row(0, 1)  # move a short row over a long one
    bt.commit_block_table(2)
    assert bt.block_table.gpu[1].tolist() == [5] + [0] * 11
    assert_zero_tails(bt)


def test_errors_name_the_field_and_rule():
    bt = make_table("delta", max_blocks=4)
    bt.add_row([1, 2, 3], 0)
    with pytest.raises(ValueError, match="max_num_blocks_per_req=4"):
        bt.append_row([4, 5], 0)
    assert row_list(bt, 0) == [1, 2, 3]  # nothing changed
    with pytest.raises(ValueError, match="row_idx"):
        bt.add_row([1], 8)
    with pytest.raises(ValueError, match="block_ids must be >= 0"):
        bt.append_row([-3], 1)
    with pytest.raises(ValueError, match="num_reqs"):
        bt.commit_block_table(9)
    with pytest.raises(ValueError, match="commit_mode"):
        bt.commit_mode = "sometimes"
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(0, 4, 4, 4, False, CPU)
    qsl, pos = batch([[0]])
    with pytest.raises(ValueError, match="query_start_loc"):
        bt.compute_slot_mapping(2, qsl, pos)
    mg = MultiGroupBlockTable(4, 64, 32, False, CPU, [16, 32])
    with pytest.raises(ValueError, match="one list per group"):
        mg.add_row(([1],), 0)
    with pytest.raises(ValueError, match="max_num_blocks_per_req=2"):  # group 1: 64 / 32
        mg.add_row(([1, 2, 3], [4, 5, 6]), 0)
    assert mg[0].num_blocks_per_row[0] == 0  # group 0 untouched by the failed call


def random_ops(bt, model, rng, next_id, steps):
    """Applies `steps` random row operations to bt and to the Python model (dict row -> list)."""
    max_blocks, max_reqs = bt.max_num_blocks_per_req, bt.max_num_reqs
    for _ in range(steps):
        op = rng.choice(["add", "append", "append", "append", "clear", "move", "swap"])
        r, s = rng.randrange(max_reqs), rng.randrange(max_reqs)
        if op == "add":
            ids = [next(next_id) for _ in range(rng.randint(0, max_blocks))]
            bt.add_row(ids, r)
            model[r] = ids
        elif op == "append":
            ids = [next(next_id) for _ in range(rng.randint(0, max_blocks - len(model[r])))]
            bt.append_row(ids, r)
            model[r] = model[r] + ids
        elif op == "clear":
            bt.clear_row(r)
            model[r] = []
        elif op == "move":
            bt.move_row(s, r)
            model[r] = list(model[s])
        else:
            bt.swap_row(s, r)
            model[r], model[s] = model[s], model[r]


def random_step(rng, model, num_reqs, block_size, max_tokens):
    """Random query lengths and positions inside each row's blocks, within the token budget."""
    seqs, budget = [], max_tokens
    for r in range(num_reqs):
        cap = len(model[r]) * block_size
        q = min(budget, rng.randint(0, min(cap, 40)))
        budget -= q
        seqs.append(sorted(rng.sample(range(cap), q)) if q else [])
    return seqs


def ids_counter(start=1):
    i = start
    while True:
        yield i
        i += 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sequences_against_python_model(mode, seed):
    rng = random.Random(seed)
    bs, max_tokens = 4, 160
    bt = make_table(mode, block_size=bs, max_reqs=6, max_blocks=10, max_tokens=max_tokens)
    model = {r: [] for r in range(bt.max_num_reqs)}
    next_id = ids_counter()
    for _ in range(25):
        random_ops(bt, model, rng, next_id, rng.randint(1, 8))
        for r in range(bt.max_num_reqs):
            assert row_list(bt, r) == model[r]
        assert_zero_tails(bt)
        num_reqs = rng.randint(0, bt.max_num_reqs)
        bt.commit_block_table(num_reqs)
        assert torch.equal(bt.block_table.gpu[:num_reqs], bt.block_table.cpu[:num_reqs])
        seqs = random_step(rng, model, num_reqs, bs, max_tokens)
        qsl, pos = batch(seqs, pad_to=max_tokens)
        bt.compute_slot_mapping(num_reqs, qsl, pos)
        want = expected_slots(model, seqs, bs, max_tokens)
        assert bt.slot_mapping.gpu.tolist() == want
        ref = slot_mapping_ref(bt.block_table.gpu, bs, qsl, pos, num_reqs, max_tokens)
        assert ref.tolist() == want


class CountingKernel:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("mode", MODES)
def test_multi_group_single_launch(mode, monkeypatch):
    mg = MultiGroupBlockTable(
        max_num_reqs=4,
        max_model_len=96,
        max_num_batched_tokens=64,
        pin_memory=True,
        device=CPU,
        block_sizes=[16, 32],
        commit_mode="full" if mode == "full" else "delta",
    )
    for bt in mg.block_tables:
        bt.full_copy_fallback = mode != "delta_only"
    assert [bt.max_num_blocks_per_req for bt in mg.block_tables] == [6, 3]
    rows = {0: ([10, 25, 7], [3, 4]), 1: ([5], [8]), 2: ([11, 12], [9])}
    for r, ids in rows.items():
        mg.add_row(ids, r)
    mg.append_row(([13], [14]), 1)
    mg.swap_row(0, 2)
    mg.commit_block_table(3)
    seqs = [[17, 20], [0, 16, 31], [33, 40, 47]]
    qsl, pos = batch(seqs, pad_to=64)
    counter = CountingKernel(sm.slot_mapping_kernel)
    monkeypatch.setattr(sm, "slot_mapping_kernel", counter)
    mg.compute_slot_mapping(3, qsl, pos)
    assert counter.launches == 1
    final = [rows[2], ([5, 13], [8, 14]), rows[0]]
    for gid, bs in enumerate([16, 32]):
        got = mg[gid].slot_mapping.gpu.tolist()
        assert got == expected_slots([f[gid] for f in final], seqs, bs, 64)
    assert mg[0].slot_mapping.gpu[0].item() == 12 * 16 + 1
    assert mg[1].slot_mapping.gpu[0].item() == 9 * 32 + 17


def test_cpu_buffers_are_separate_and_not_pinned_without_cuda():
    bt = make_table("full")
    assert bt.block_table.gpu.data_ptr() != bt.block_table.cpu.data_ptr()
    assert bt.block_table.cpu.is_pinned() == torch.cuda.is_available()
    assert isinstance(bt.num_blocks_per_row, np.ndarray)
    assert bt.num_blocks_per_row.dtype == np.int32
    bt.add_row([1], 0)
    assert bt.block_table.gpu[0, 0].item() == 0  # nothing reaches the device before a commit
