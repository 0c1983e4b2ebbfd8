"""Which requests the scheduler may take at all, and when it lets the waiting ones in.

`RequestFit` holds the pool's geometry and refuses, at add time, a request that could never be
scheduled (no prompt, a prompt longer than max_model_len, more blocks than the pool holds). `AdmissionGate`
decides whether a step keeps the waiting requests out to admit them later, together.
"""

from __future__ import annotations

from typing import Any

from kvcore.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_positive_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Scheduler.{name}={value!r}: must be an integer >= {minimum}")


class RequestFit:
    def __init__(self, kv_cache_config: Any, num_pool_blocks: int, max_model_len: int, max_chunk: int) -> None:
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.block_sizes = [s.block_size for s in specs]
        self.windows = [getattr(s, "sliding_window", None) for s in specs]
        self.num_pool_blocks = num_pool_blocks
        self.max_model_len = max_model_len
        self.max_chunk = max_chunk  # the most tokens one step computes for one request
        # Fast path of the running loop: allocate_slots is a no-op when the new tokens land in the
        # request's last block (already allocated: it holds position c - 1) without filling it (no
        # block to register in the prefix cache). That holds for full-attention groups of one block
        # size; a sliding window also frees blocks as decode advances, so it always asks the manager.
        uniform = len(set(self.block_sizes)) == 1 and all(w is None for w in self.windows)
        # 1 disables the fast path without a branch in the loop: c % 1 is never non-zero.
        self.fast_block_size = self.block_sizes[0] if uniform else 1

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request can hold at once with `num_tokens` tokens, over all groups (one pool)."""
        total = 0
        for bs, window in zip(self.block_sizes, self.windows, strict=True):
            need = cdiv(num_tokens, bs)
            if window is not None:
                # Live blocks cover the window behind the computed tokens plus one chunk.
                need = min(need, cdiv(window - 1 + self.max_chunk, bs) + 1)
            total += need
        return total

    def reject_reason(self, request: Request) -> str | None:
        rid = request.request_id
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return f"request {rid!r}: prompt_token_ids is empty; a request needs at least one prompt token"
        if num_prompt > self.max_model_len:
            return (
                f"request {rid!r}: prompt ({num_prompt} tokens) exceeds max_model_len={self.max_model_len}; "
                f"a prompt must fit the model's context"
            )
        # max_tokens past max_model_len is capped there (finish_reason "length"), as in vLLM.
        total = min(num_prompt + request.max_tokens, self.max_model_len)
        need = self.max_blocks_needed(total)
        usable = self.num_pool_blocks - 1
        if need > usable:
            return (
                f"request {rid!r}: prompt + max_tokens = {total} tokens (capped by max_model_len="
                f"{self.max_model_len}) needs {need} KV-cache blocks "
                f"(block sizes {self.block_sizes}) but the pool holds only {usable} usable blocks "
                f"(num_blocks={self.num_pool_blocks}, block 0 is the null block)"
            )
        return None


class AdmissionGate:
    """Whether a step keeps the waiting requests out to admit them later, together.

    A step that starts new prompts mixes their prefill into the running decodes, and such a step
    cannot replay a decode CUDA graph: it launches every kernel from the host. When requests finish
    one or two at a time, admitting each at once makes nearly every step mixed. With min_batch > 1
    they are admitted once that many rows are free (or every waiting request fits, or nothing runs,
    or they have waited max_wait_steps steps), so most steps stay pure decode (TGI batches its
    prefills for the same reason)."""

    def __init__(self, max_num_seqs: int, min_batch: int, max_wait_steps: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.min_batch = min_batch
        self.max_wait_steps = max_wait_steps
        self._deferrals = 0  # consecutive steps that kept waiting requests out

    def deferred(self, num_running: int, num_waiting: int) -> bool:
        free = self.max_num_seqs - num_running
        if free <= 0:
            return True  # no row to admit into: not a deferral
        if not num_running or free >= min(self.min_batch, num_waiting) or self._deferrals >= self.max_wait_steps:
            self._deferrals = 0
            return False
        self._deferrals += 1
        return True
