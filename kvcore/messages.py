"""The control plane: what the driver sends each worker per step, and what comes back.

These messages never carry tensors; their size grows with the number of changes in a step,
not with context length. They use __slots__: the scheduler builds one EngineCoreOutput per running
request per step, and slotted instances are cheaper to create. Their wire form (pickle's and the shm
transport's) is derived from their fields by kvcore/wire.py: `@message`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvcore.logprob_rows import Logprobs, LogprobsBatch
from kvcore.request import SamplingParams
from kvcore.wire import message

BlockIds = tuple[list[int], ...]  # one list per KV-cache group


@message
@dataclass(slots=True)
class NewRequestData:
    """A request scheduled for the first time: its full block list per group."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int
    # Outputs the request already had when it arrived (it continues a stream another engine began).
    output_token_ids: list[int] | None = None


@message
@dataclass(slots=True)
class CachedRequestData:
    """Requests the workers already know. Index i of every list describes req_ids[i].

    new_block_ids[i] is the delta per group (blocks appended since last step), or None when nothing
    was added. For a request resumed from preemption it is the full list, which replaces the row,
    and resumed_token_ids[i] holds its full token ids (prompt + output so far).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    resumed_token_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(
        self,
        req_id: str,
        new_block_ids: BlockIds | None,
        num_computed_tokens: int,
        resumed_token_ids: list[int] | None = None,
    ) -> None:
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed_token_ids is not None)
        self.new_block_ids.append(new_block_ids)
        self.resumed_token_ids.append(resumed_token_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def add_running_rows(self, req_ids: dict[str, int], deltas: list[tuple[int, BlockIds]]) -> None:
        """The other per-row lists of running requests whose num_computed_tokens the scheduler already
        appended, in order: no resume, and new blocks only in the rows `deltas` names (row, ids)."""
        self.req_ids.extend(req_ids)
        k = len(req_ids)
        new_block_ids = self.new_block_ids
        new_block_ids.extend([None] * k)
        for row, ids in deltas:
            new_block_ids[row] = ids
        self.resumed_from_preemption.extend([False] * k)
        self.resumed_token_ids.extend([None] * k)


@message
@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions. `num_scheduled_tokens` maps every scheduled req_id to its token count.

    `finished_req_ids` lists requests finished (or aborted) since the previous step: workers drop their
    state. `preempted_req_ids` lists requests preempted this step: workers drop their rows; they come
    back later through `scheduled_cached_reqs` with resumed_from_preemption set.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    step_id: int = 0
    # Pipeline parallelism only (else None): per scheduled request, the tokens after its prompt that
    # this step computes. The first stage embeds them and never sampled them (the last stage did).
    pipeline_token_ids: dict[str, list[int]] | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@message
@dataclass(slots=True)
class ModelRunnerOutput:
    """What rank 0 returns: the tokens it sampled, per scheduled request.

    sampled_token_ids[i] belongs to req_ids[i]; it is empty for a request whose prefill is still
    partial this step (nothing is sampled for it). `logprobs` holds the rows of every request that
    sampled this step, one per sampled token, as one batch (req_ids and ks say whose rows and which k
    each asked; -1: none), when any of them asked (SamplingParams.logprobs). `prompt_logprobs` holds,
    for requests that asked and sampled their first token this step, every prompt position from the
    second on (P = prompt length - 1): vLLM's prompt_logprobs without its leading None.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    step_id: int = 0
    logprobs: LogprobsBatch | None = None
    prompt_logprobs: dict[str, Logprobs] | None = None
    cudagraph: bool = False  # the step replayed a CUDA graph (the engine reports the share)


@message(inline=False)  # set on a request's last output only: the outputs keep their C-speed encoder
@dataclass(slots=True)
class RequestTiming:
    """Per finished request, measured on the driver: seconds from arrival."""

    ttft_s: float | None
    e2e_s: float
    num_prompt_tokens: int
    num_output_tokens: int


@message
@dataclass(slots=True)
class EngineCoreOutput:
    """The per-step news for one request, as the scheduler hands it to the client side (and the client
    side to its users: the driver adds `timing` to a request's last output)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id, when a stop token ended it
    error: str | None = None
    num_cached_tokens: int = 0
    # The sampled rows of the step that made this output, every request's of that step (one object for
    # all of them, so the output path never splits them per request); `logprobs` reads this request's.
    step_logprobs: LogprobsBatch | None = None
    prompt_logprobs: Logprobs | None = None  # with the first token, when SamplingParams.prompt_logprobs is set
    timing: RequestTiming | None = None  # on the last output, set by the driver

    @property
    def logprobs(self) -> Logprobs | None:
        """This request's rows, one per new token, when SamplingParams.logprobs is set."""
        batch = self.step_logprobs
        if batch is None or not self.new_token_ids:
            return None
        return batch.rows_for(self.request_id, len(self.new_token_ids))


# The scheduler's _apply_sampled builds the EngineCoreOutput of an unfinished request by filling a bare
# instance (one per running request per step, so the __init__ call is worth skipping); it sets exactly
# these fields, so a new field must be added there too.
ENGINE_CORE_OUTPUT_FIELDS = (
    "request_id",
    "new_token_ids",
    "finished",
    "finish_reason",
    "stop_reason",
    "error",
    "num_cached_tokens",
    "step_logprobs",
    "prompt_logprobs",
    "timing",
)
if tuple(f.name for f in fields(EngineCoreOutput)) != ENGINE_CORE_OUTPUT_FIELDS:
    raise RuntimeError(
        "kvcore.messages: EngineCoreOutput's fields changed; update Scheduler._apply_sampled, which fills "
        f"{ENGINE_CORE_OUTPUT_FIELDS} by hand"
    )
