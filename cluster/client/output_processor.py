"""The client side of every request: engine outputs (token ids, logprobs) -> RequestOutputs.

As vLLM V1's OutputProcessor: it detokenizes incrementally, checks stop strings on that text (the
engine only knows stop *tokens*), cuts the text before the stop string unless
include_stop_str_in_output, sets finish_reason / stop_reason, and says which requests the engine must
abort because a stop string ended them here. A request with n > 1 fans out into n child requests (as
vLLM's ParentRequest) with ids "<k>_<request_id>"; they share the prompt's KV through the prefix cache,
and a seeded request's children get seeds seed + k. Used by LLM.generate/chat; it knows nothing of
Ray, so the server and the batch job can drive it with the same engine outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cluster.client.bad_words import with_bad_words_tokenized
from cluster.client.detokenizer import IncrementalDetokenizer, check_stop_strings
from cluster.client.logprobs import LogprobsProcessor, TokenDecoder
from cluster.outputs import CompletionOutput, RequestOutput
from kvcore.messages import EngineCoreOutput
from kvcore.request import SamplingParams


class RequestState:
    """One engine request (a child of a ParentRequest): its text, tokens, logprobs and stop state."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        decoder: TokenDecoder | None = None,
        incremental: bool = False,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.incremental = incremental  # text as tokens arrive (a stream), not only at the end
        self.completion = CompletionOutput(index, "", [])
        detok = params.detokenize and tokenizer is not None
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens) if detok else None
        )
        self.logprobs = LogprobsProcessor(
            tokenizer if detok else None, params.logprobs, params.prompt_logprobs, decoder
        )
        self.error: str | None = None
        self.timing: Any = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None

    def update(self, o: EngineCoreOutput) -> bool:
        """Take one engine output; True when a stop string ended the request here (the engine must abort it)."""
        # As vLLM: the EOS / stop token that ended a request adds no text unless include_stop_str_in_output.
        stop_terminated = o.finished and o.finish_reason == "stop"
        skip_last = stop_terminated and not self.params.include_stop_str_in_output
        self.logprobs.update(o, len(o.new_token_ids))
        for k, tok in enumerate(o.new_token_ids):
            self.completion.token_ids.append(tok)
            if self.detokenizer is None or (skip_last and k == len(o.new_token_ids) - 1):
                continue
            if not self.params.stop and not self.incremental:
                self.detokenizer.append(tok)  # decoded once, at the end
            elif self._check_stop(self.detokenizer.decode_next(tok)):
                self.logprobs.truncate(len(self.completion.token_ids))
                return True
        if o.finished:
            # Held-back bytes can still complete a stop string; the engine has finished the request anyway.
            by_stop_string = self.detokenizer is not None and self._check_stop(self.detokenizer.flush())
            self._finish(o, keep_reason=by_stop_string)
        return False

    def _check_stop(self, delta: str) -> bool:
        detok, p = self.detokenizer, self.params
        assert detok is not None  # called only where a detokenizer exists
        self.completion.text = detok.output_text
        # Text of the first min_tokens tokens cannot complete a stop string (vLLM's min_tokens rule).
        if not p.stop or not delta or len(self.completion.token_ids) <= p.min_tokens:
            return False
        assert isinstance(p.stop, list)  # SamplingParams.__post_init__ normalizes stop to a list
        hit = check_stop_strings(detok.output_text, len(delta), p.stop, p.include_stop_str_in_output)
        if hit is None:
            return False
        stop_str, cut = hit
        if cut != -1:
            detok.output_text = detok.output_text[:cut]
        self.completion.text = detok.output_text
        self.completion.finish_reason, self.completion.stop_reason = "stop", stop_str
        return True

    def _finish(self, o: EngineCoreOutput, keep_reason: bool = False) -> None:
        c = self.completion
        if not keep_reason:
            c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        self.error, self.timing, self.num_cached_tokens = o.error, o.timing, o.num_cached_tokens

    def fail(self, message: str) -> None:
        self.completion.finish_reason, self.error = "error", message


@dataclass
class ParentRequest:
    """One prompt as the user sent it, with its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[RequestState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def output(self) -> RequestOutput:
        for c in self.children:
            c.completion.logprobs, c.completion.cumulative_logprob = c.logprobs.logprobs, c.logprobs.cumulative_logprob
        first = self.children[0]
        errors = [c.error for c in self.children if c.error is not None]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            first.logprobs.prompt_logprobs,
            [c.completion for c in self.children],
            self.finished,
            first.timing,
            first.num_cached_tokens,
            errors[0] if errors else None,
        )


def child_params(params: SamplingParams, k: int) -> SamplingParams:
    """The k-th sample of an n-sample request: n=1, and seed + k when seeded (distinct, reproducible)."""
    return replace(params, n=1, seed=None if params.seed is None else params.seed + k)


class OutputProcessor:
    def __init__(self, tokenizer: Any, incremental: bool = False) -> None:
        self.tokenizer = tokenizer
        self.decoder = None if tokenizer is None else TokenDecoder(tokenizer)  # shared by every request
        self.incremental = incremental  # the server's streams: decode every token as it arrives
        self.states: dict[str, tuple[RequestState, ParentRequest]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[ParentRequest, list[tuple[str, SamplingParams]]]:
        """Register a request; -> (its parent record, the (engine request id, params) to submit)."""
        params = with_bad_words_tokenized(params, self.tokenizer)
        parent = ParentRequest(request_id, prompt, prompt_token_ids)
        subs = (
            [(request_id, params)]
            if params.n == 1
            else [(f"{k}_{request_id}", child_params(params, k)) for k in range(params.n)]
        )
        for k, (rid, sp) in enumerate(subs):
            state = RequestState(rid, k, prompt_token_ids, sp, self.tokenizer, self.decoder, self.incremental)
            parent.children.append(state)
            self.states[rid] = (state, parent)
        return parent, subs

    def fail(self, request_id: str, message: str) -> ParentRequest | None:
        """An engine request refused at submit; -> its parent when that finished it."""
        state, parent = self.states.pop(request_id)
        state.fail(message)
        return parent if parent.finished else None

    def process_output(self, o: EngineCoreOutput) -> tuple[ParentRequest | None, bool]:
        """-> (the parent, when this output finished it; whether the engine must abort o.request_id)."""
        entry = self.states.get(o.request_id)
        if entry is None:
            return None, False  # finished here already (e.g. the abort echo after a stop string)
        state, parent = entry
        abort = state.update(o)
        if state.finished:
            del self.states[o.request_id]
        return (parent if state.finished and parent.finished else None), abort

    def has_unfinished(self) -> bool:
        return bool(self.states)
