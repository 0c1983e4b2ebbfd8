"""A step's model inputs built on the device from per-row state: query_start_loc, seq_lens,
logits_indices, positions and input ids.

The host stages one small int32 record per step (see `StageLayout`): the number of rows and of
sampling rows, and per row the tokens scheduled, the tokens already computed, where the row's first
token comes from when the device has it (the index of the token the previous step sampled for it, or
-1), the rows that sample, and the token ids only the host knows (prompt chunks), each at its own
position in the step's token order. Two kernels turn that record into the inputs:

- `_prep_rows_kernel` (one program): query_start_loc by a prefix sum over the rows, padded to
  `num_seqs` entries with the token count (padding sequences hold no tokens), seq_lens, and the
  logits index (last token) of every sampling row.
- `_prep_tokens_kernel` (tiles of tokens over the padded token count): each token finds its row by
  binary search over query_start_loc, then gets its position (computed + offset) and its id (the
  device-fed token for the first token of a fed row, else the staged host token); padding tokens get
  id 0 at position 0.

Neither kernel takes a host value that changes between steps: the row counts come from the staged
record, the paddings (`num_seqs`, the token count) are the bucket's. So the two launches can sit in a
CUDA graph replayed for any step of the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcore.kernels.token_rows import search_steps, token_rows

TOKEN_TILE = 256
HEADER = 4  # num_reqs, num_sample_rows, 2 spare words


@dataclass(frozen=True)
class StageLayout:
    """Offsets (int32 words) of the staged record's sections, fixed by max_num_reqs / max_num_tokens."""

    max_num_reqs: int
    max_num_tokens: int

    @property
    def sched(self) -> int:
        return HEADER

    @property
    def computed(self) -> int:
        return HEADER + self.max_num_reqs

    @property
    def feed(self) -> int:
        return HEADER + 2 * self.max_num_reqs

    @property
    def sample(self) -> int:
        return HEADER + 3 * self.max_num_reqs

    @property
    def tokens(self) -> int:
        return HEADER + 4 * self.max_num_reqs

    @property
    def size(self) -> int:
        return self.tokens + self.max_num_tokens


@triton.jit(do_not_specialize=["num_seqs"])
def _prep_rows_kernel(
    stage_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    logits_idx_ptr: tl.tensor,
    num_seqs: tl.tensor,
    OFF_SCHED: tl.constexpr,
    OFF_COMP: tl.constexpr,
    OFF_SAMPLE: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> None:
    num_reqs = tl.load(stage_ptr)
    num_sample = tl.load(stage_ptr + 1)
    r = tl.arange(0, BLOCK_R)
    live = r < num_reqs
    sched = tl.load(stage_ptr + OFF_SCHED + r, mask=live, other=0)
    comp = tl.load(stage_ptr + OFF_COMP + r, mask=live, other=0)
    ends = tl.cumsum(sched, 0)  # rows past num_reqs add 0: padding sequences start at the total
    in_seqs = r < num_seqs
    tl.store(qsl_ptr + 1 + r, ends, mask=in_seqs)
    tl.store(qsl_ptr + r, 0, mask=r == 0)
    tl.store(seq_lens_ptr + r, tl.where(live, comp + sched, 0), mask=in_seqs)
    tl.debug_barrier()  # the stores above are read back below by other threads of this program
    k = tl.arange(0, BLOCK_R)
    sampling = k < num_sample
    row = tl.load(stage_ptr + OFF_SAMPLE + k, mask=sampling, other=0)
    last = tl.load(qsl_ptr + 1 + row, mask=sampling, other=1) - 1
    tl.store(logits_idx_ptr + k, last.to(tl.int64), mask=sampling)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens_pad", "search_steps"])
def _prep_tokens_kernel(
    stage_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    fed_ptr: tl.tensor,
    input_ids_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    num_seqs: tl.tensor,
    num_tokens_pad: tl.tensor,
    search_steps: tl.tensor,
    OFF_COMP: tl.constexpr,
    OFF_FEED: tl.constexpr,
    OFF_TOK: tl.constexpr,
    TILE: tl.constexpr,
) -> None:
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    in_buf = offs < num_tokens_pad
    num_tokens = tl.load(qsl_ptr + num_seqs)
    is_tok = in_buf & (offs < num_tokens)
    row = tl.where(is_tok, token_rows(qsl_ptr, num_seqs, offs, is_tok, search_steps, TILE), 0)
    first = tl.load(qsl_ptr + row, mask=is_tok, other=0)
    j = offs - first
    pos = tl.load(stage_ptr + OFF_COMP + row, mask=is_tok, other=0) + j
    feed = tl.load(stage_ptr + OFF_FEED + row, mask=is_tok, other=-1)
    use_fed = is_tok & (feed >= 0) & (j == 0)
    fed = tl.load(fed_ptr + feed, mask=use_fed, other=0)
    host = tl.load(stage_ptr + OFF_TOK + offs, mask=is_tok & ~use_fed, other=0)
    ids = tl.where(use_fed, fed, host.to(tl.int64))
    tl.store(input_ids_ptr + offs, tl.where(is_tok, ids, 0), mask=in_buf)
    tl.store(positions_ptr + offs, tl.where(is_tok, pos, 0).to(tl.int64), mask=in_buf)


@dataclass
class PrepOutputs:
    """The device buffers the kernels write (persistent: CUDA graphs read them by address)."""

    query_start_loc: torch.Tensor  # int32 [max_num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [max_num_reqs]
    logits_indices: torch.Tensor  # int64 [max_num_reqs]
    input_ids: torch.Tensor  # int64 [max_num_tokens]
    positions: torch.Tensor  # int64 [max_num_tokens]


def prepare_inputs(
    stage: torch.Tensor,
    layout: StageLayout,
    fed: torch.Tensor,
    out: PrepOutputs,
    num_seqs: int,
    num_tokens_pad: int,
    use_triton: bool,
) -> None:
    """Fill `out` for a step padded to `num_seqs` sequences and `num_tokens_pad` tokens from the
    staged record `stage` (device int32 [layout.size]) and the previous step's sampled tokens `fed`."""
    if use_triton:
        _prep_rows_kernel[(1,)](
            stage,
            out.query_start_loc,
            out.seq_lens,
            out.logits_indices,
            num_seqs,
            OFF_SCHED=layout.sched,
            OFF_COMP=layout.computed,
            OFF_SAMPLE=layout.sample,
            BLOCK_R=max(16, triton.next_power_of_2(layout.max_num_reqs + 1)),
        )
        _prep_tokens_kernel[(triton.cdiv(num_tokens_pad, TOKEN_TILE),)](
            stage,
            out.query_start_loc,
            fed,
            out.input_ids,
            out.positions,
            num_seqs,
            num_tokens_pad,
            search_steps(num_seqs),
            OFF_COMP=layout.computed,
            OFF_FEED=layout.feed,
            OFF_TOK=layout.tokens,
            TILE=TOKEN_TILE,
        )
        return
    prepare_inputs_ref(stage, layout, fed, out, num_seqs, num_tokens_pad)


def prepare_inputs_ref(
    stage: torch.Tensor, layout: StageLayout, fed: torch.Tensor, out: PrepOutputs, num_seqs: int, num_tokens_pad: int
) -> None:
    """Plain-torch reference of the two kernels (reads device values: a host sync)."""
    num_reqs, num_sample = int(stage[0]), int(stage[1])
    sched = stage[layout.sched : layout.sched + num_reqs].to(torch.int64)
    comp = stage[layout.computed : layout.computed + num_reqs].to(torch.int64)
    feed = stage[layout.feed : layout.feed + num_reqs].to(torch.int64)
    ends = torch.cumsum(sched, 0)
    total = int(ends[-1]) if num_reqs else 0
    qsl = torch.full((num_seqs + 1,), total, dtype=torch.int64, device=stage.device)
    qsl[0] = 0
    qsl[1 : num_reqs + 1] = ends
    out.query_start_loc[: num_seqs + 1] = qsl.to(torch.int32)
    seq_lens = torch.zeros(num_seqs, dtype=torch.int64, device=stage.device)
    seq_lens[:num_reqs] = comp + sched
    out.seq_lens[:num_seqs] = seq_lens.to(torch.int32)
    rows = stage[layout.sample : layout.sample + num_sample].to(torch.int64)
    out.logits_indices[:num_sample] = qsl[rows + 1] - 1
    row = torch.repeat_interleave(torch.arange(num_reqs, device=stage.device), sched)
    j = torch.arange(total, device=stage.device) - qsl[row]
    ids = stage[layout.tokens : layout.tokens + total].to(torch.int64)
    use_fed = (feed[row] >= 0) & (j == 0)
    if bool(use_fed.any()):
        ids = torch.where(use_fed, fed[feed[row].clamp(min=0)].to(torch.int64), ids)
    out.input_ids[:total] = ids
    out.positions[:total] = comp[row] + j
    out.input_ids[total:num_tokens_pad] = 0
    out.positions[total:num_tokens_pad] = 0
