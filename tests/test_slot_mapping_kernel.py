"""The Triton kernels (interpreted on CPU tensors) against their plain-torch references on random
inputs, and the delta-committed device table against the CPU table after random operations."""

import random

import pytest
import torch

import kvcore.kernels.block_table_delta as delta_mod
from kvcore.block_table import BlockTable, MultiGroupBlockTable
from kvcore.kernels.block_table_delta import apply_block_table_delta, apply_block_table_delta_ref
from kvcore.kernels.slot_mapping import TOKEN_TILE, SlotMappingLaunch, slot_mapping_ref, triton_runs_on

CPU = torch.device("cpu")


def random_batch(gen, num_reqs, max_pos, max_q, pos_dtype):
    lens = torch.randint(0, max_q + 1, (num_reqs,), generator=gen)
    if num_reqs:
        lens[torch.randint(0, num_reqs, (1,), generator=gen)] = 0  # an idle row in the batch
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    total = int(qsl[-1])
    # Spare entries past the real tokens: the kernel must not read them as tokens.
    positions = torch.randint(0, max_pos, (total + 7,), generator=gen, dtype=pos_dtype)
    return qsl, positions


@pytest.mark.parametrize("seed", range(6))
def test_slot_mapping_kernel_matches_reference(seed):
    assert triton_runs_on(CPU)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_groups = rng.randint(1, 3)
    max_reqs = rng.choice([1, 3, 8, 17])
    max_len = 512
    block_sizes = [rng.choice([1, 4, 16, 32]) for _ in range(num_groups)]
    buffer_len = rng.choice([5, TOKEN_TILE, TOKEN_TILE + 3, 3 * TOKEN_TILE - 1])
    tables = [
        torch.randint(0, 1 << 20, (max_reqs, -(-max_len // bs)), generator=gen, dtype=torch.int32) for bs in block_sizes
    ]
    outs = [torch.full((buffer_len,), 12345, dtype=torch.int64) for _ in block_sizes]
    launch = SlotMappingLaunch(tables, outs, block_sizes, max_reqs)
    for num_reqs in (0, rng.randint(1, max_reqs), max_reqs):
        max_q = max(1, buffer_len // max(1, num_reqs))
        qsl, positions = random_batch(gen, num_reqs, max_len, max_q, rng.choice([torch.int32, torch.int64]))
        before = [o.clone() for o in outs]
        launch(num_reqs, qsl, positions)
        n = min(positions.numel(), buffer_len)  # the step's entries (padding included) are written
        for table, bs, out, old in zip(tables, block_sizes, outs, before, strict=True):
            ref = slot_mapping_ref(table, bs, qsl, positions, num_reqs, n)
            assert torch.equal(out[:n], ref)
            assert torch.equal(out[n:], old[n:])  # nothing past them


@pytest.mark.parametrize("seed", range(4))
def test_delta_kernel_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, cols = 7, 300
    table = torch.randint(0, 100, (rows, cols), generator=gen, dtype=torch.int32)
    expected = table.clone()
    for dtype in (torch.int32, torch.int64):
        n = int(torch.randint(1, rows * cols + 1, (1,), generator=gen))
        index = torch.randperm(rows * cols, generator=gen)[:n].to(dtype)
        value = torch.randint(0, 1 << 30, (n,), generator=gen).to(dtype)
        packed = torch.cat([index, value])
        apply_block_table_delta(table, packed, n, use_triton=True)
        apply_block_table_delta_ref(expected, packed, n)
        assert torch.equal(table, expected)
        assert torch.equal(table.view(-1)[index.long()], value.to(torch.int32))


def random_row_ops(bt, rng, steps, next_id):
    for _ in range(steps):
        op = rng.choice(["add", "append", "append", "clear", "move", "swap"])
        r, s = rng.randrange(bt.max_num_reqs), rng.randrange(bt.max_num_reqs)
        room = bt.max_num_blocks_per_req - int(bt.num_blocks_per_row[r])
        if op == "add":
            bt.add_row([next(next_id) for _ in range(rng.randint(0, bt.max_num_blocks_per_req))], r)
        elif op == "append":
            bt.append_row([next(next_id) for _ in range(rng.randint(0, min(room, 3)))], r)
        elif op == "clear":
            bt.clear_row(r)
        elif op == "move":
            bt.move_row(s, r)
        else:
            bt.swap_row(s, r)


def counter():
    i = 1
    while True:
        yield i
        i += 1


@pytest.mark.parametrize("variant", ["delta_only", "fallback", "tiny_staging", "mode_switch", "int64_index"])
@pytest.mark.parametrize("seed", range(3))
def test_delta_committed_table_equals_cpu_table(variant, seed, monkeypatch):
    rng = random.Random(seed)
    if variant == "int64_index":
        monkeypatch.setattr(delta_mod, "INDEX32_LIMIT", 16)
    bt = BlockTable(8, 9, 40, 64, pin_memory=True, device=CPU, commit_mode="delta")
    bt.full_copy_fallback = variant == "fallback"
    if variant == "tiny_staging":
        bt.delta_uploader.capacity = 5  # most commits overflow it and fall back to whole rows
    ids = counter()
    for step in range(40):
        if variant == "mode_switch":
            bt.commit_mode = rng.choice(["full", "delta"])
        random_row_ops(bt, rng, rng.randint(0, 6), ids)
        num_reqs = rng.randint(0, bt.max_num_reqs)
        bt.commit_block_table(num_reqs)
        if bt.commit_mode == "delta":
            assert torch.equal(bt.block_table.gpu, bt.block_table.cpu), f"step {step}"
        else:
            assert torch.equal(bt.block_table.gpu[:num_reqs], bt.block_table.cpu[:num_reqs])
    bt.commit_mode = "delta"
    bt.commit_block_table(0)  # rows a full commit of [0, num_reqs) skipped are still pending
    assert torch.equal(bt.block_table.gpu, bt.block_table.cpu)


def test_decode_step_delta_is_one_cell_per_appended_block():
    bt = BlockTable(16, 64, 1000, 64, pin_memory=False, device=CPU, commit_mode="delta")
    for r in range(64):
        bt.add_row(list(range(1 + r * 900, 1 + r * 900 + 900)), r)
    bt.commit_block_table(64)
    sent = []
    real_upload = bt.delta_uploader.upload

    def upload(parts):
        sent.append(sum(len(p) for p in parts))
        return real_upload(parts)

    bt.delta_uploader.upload = upload
    for r in range(0, 64, 2):
        bt.append_row([100_000 + r], r)
    bt.commit_block_table(64)
    assert sent == [32]  # 32 cells, whatever max_num_blocks_per_req is
    assert torch.equal(bt.block_table.gpu, bt.block_table.cpu)


def test_multi_group_delta_commit_and_reference_backend_agree():
    mg = MultiGroupBlockTable(6, 256, 96, True, CPU, [16, 32, 8], commit_mode="delta")
    rng = random.Random(7)
    ids = counter()
    for r in range(6):
        n = rng.randint(1, 4)
        mg.add_row(tuple([next(ids) for _ in range(n * k)] for k in (2, 1, 4)), r)
    mg.swap_row(1, 4)
    mg.move_row(5, 0)
    mg.commit_block_table(6)
    for bt in mg.block_tables:
        assert torch.equal(bt.block_table.gpu, bt.block_table.cpu)
    lens = [int(mg[1].num_blocks_per_row[r]) * 32 for r in range(6)]
    pos = [sorted(rng.sample(range(n), min(n, 12))) for n in lens]
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(p) for p in pos]), 0)), dtype=torch.int32)
    positions = torch.tensor([p for ps in pos for p in ps], dtype=torch.int64)
    mg.compute_slot_mapping(6, qsl, positions)
    triton_out = [bt.slot_mapping.gpu.clone() for bt in mg.block_tables]
    mg.use_triton = False  # the torch path CPU runs without the interpreter take
    for bt in mg.block_tables:
        bt.use_triton = False
        bt.slot_mapping.gpu.fill_(7)
    mg.compute_slot_mapping(6, qsl, positions)
    n = positions.numel()
    for bt, out in zip(mg.block_tables, triton_out, strict=True):
        assert torch.equal(bt.slot_mapping.gpu[:n], out[:n])
        assert (bt.slot_mapping.gpu[n:] == 7).all()  # both paths write the step's entries only
