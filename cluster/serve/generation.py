"""One OpenAI request in the engine: its n engine requests, read step by step as choice deltas.

The client path of LLM.generate (cluster/client/output_processor.py: incremental detokenization, stop
strings, n samples with seed + k, logprobs) turns engine outputs into completions; this class only
says what is new since the last read. While a choice may still end in a stop string, the last
(longest stop string - 1) characters are held back, as vLLM's server does, so text a stop string
later cuts is never sent. Closing a generation before it finished (the client went away) aborts
its engine requests; their blocks return to the pool when the driver drains the abort, before its
next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from actors.messages import DOWN, REBUILDING, RequestSpec
from cluster.client.output_processor import OutputProcessor, RequestState
from cluster.outputs import Logprob, RequestOutput
from cluster.serve.engine_client import AsyncEngineClient, Inbox
from cluster.serve.errors import APIError, bad_request
from kvcore.request import SamplingParams


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


def _hold_back(params: SamplingParams) -> int:
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


class Generation:
    def __init__(
        self,
        client: AsyncEngineClient,
        tokenizer: Any,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream_interval: int = 1,
        stream_batching_s: float = 0.0,
    ) -> None:
        self.client = client
        self.stream_interval = stream_interval
        self.stream_batching_s = stream_batching_s
        self._last_sent = 0.0
        self.request_id = request_id
        self.processor = OutputProcessor(tokenizer, incremental=True)
        self.parent, subs = self.processor.add_request(request_id, prompt, prompt_token_ids, params)
        self.specs = [RequestSpec(cid, prompt_token_ids, sp) for cid, sp in subs]
        self.queue = Inbox()
        n = len(self.specs)
        self._sent_chars = [0] * n
        self._sent_tokens = [0] * n
        self._sent_finish = [False] * n
        self._hold = [_hold_back(sp) for _, sp in subs]
        self.replica: int | None = None
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.parent.finished

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.parent.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.completion.token_ids) for c in self.parent.children)

    async def start(self) -> None:
        """Submit; raises APIError (400 for a request the engine refused, 503 when it has no room)."""
        self.replica, refused = await self.client.submit(self.specs, self.queue)
        if refused:
            self.close()
            why = next(iter(refused.values()))
            if DOWN in why or REBUILDING in why:
                raise APIError(503, why, code="engine_down")
            raise bad_request(why)

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """What each choice gained, after every batch of engine outputs, until all choices finished."""
        while not self.parent.finished:
            if self.stream_batching_s and any(self._sent_tokens):
                await self._take_window()
            else:
                await self._take()
            if not self._due():
                continue
            out = self._new()
            if out:
                self._last_sent = time.monotonic()
                yield out

    async def result(self) -> RequestOutput:
        """The whole output, once every choice finished (no deltas: nothing is sent before the end)."""
        while not self.parent.finished:
            await self._take()
        return self.parent.output()

    async def _take_window(self) -> None:
        """serve.stream_batching_ms, as Ray Serve LLM batches its streams: after the first token, what
        a window brought, taken at its close; an output that ends a choice closes it at once. The
        stream sleeps through the window (waking for each step's outputs, as a first version did, cost
        the ingress more than the fewer chunks saved). With stop strings every output is read as it
        comes, since only reading it finds the end."""
        left = self._last_sent + self.stream_batching_s - time.monotonic()
        if left <= 0:  # the window closed with nothing to send: the next output goes at once
            await self._take()
            return
        ends_only = not any(self._hold)
        deadline = time.monotonic() + left
        while not self.parent.finished and left > 0:
            await self._take(left, ends_only)
            left = deadline - time.monotonic()

    async def _take(self, timeout_s: float | None = None, ends_only: bool = False) -> None:
        """Process the engine outputs that arrived (waits for the first, at most timeout_s)."""
        batch = await self.queue.take_all(timeout_s, ends_only)
        aborts = []
        for o in batch:
            _, abort = self.processor.process_output(o)
            if abort:
                aborts.append(o.request_id)  # a stop string ended it here: free its engine slot
        if aborts:
            self.client.abort(aborts)
        if self.first_token_at is None and any(o.new_token_ids for o in batch):
            self.first_token_at = time.monotonic()

    def _due(self) -> bool:
        """Whether to send now (serve.stream_interval): the first token, an end, or a full interval."""
        if self.stream_interval == 1 or not any(self._sent_tokens):
            return True
        return any(
            state.finished
            and not self._sent_finish[k]
            or len(state.completion.token_ids) - self._sent_tokens[k] >= self.stream_interval
            for k, state in enumerate(self.parent.children)
        )

    def _new(self) -> list[ChoiceDelta]:
        out = []
        for k, state in enumerate(self.parent.children):
            d = self._delta(k, state)
            if d is not None:
                out.append(d)
        return out

    def _delta(self, k: int, state: RequestState) -> ChoiceDelta | None:
        c, done = state.completion, state.finished
        if self._sent_finish[k]:
            return None
        end = len(c.text) if done else max(self._sent_chars[k], len(c.text) - self._hold[k])
        text = c.text[self._sent_chars[k] : end]
        tokens = c.token_ids[self._sent_tokens[k] :]
        rows = state.logprobs.logprobs
        lps = rows[self._sent_tokens[k] : len(c.token_ids)] if rows is not None else None
        if not text and not tokens and not done:
            return None
        self._sent_chars[k], self._sent_tokens[k], self._sent_finish[k] = end, len(c.token_ids), done
        return ChoiceDelta(
            k,
            text,
            tokens,
            lps,
            c.finish_reason if done else None,
            c.stop_reason if done else None,
            state.error if done else None,
        )

    def close(self) -> None:
        """Stop reading; engine requests still running are aborted (a client that went away)."""
        if self._closed:
            return
        self._closed = True
        ids = [s.request_id for s in self.specs]
        unfinished = [c.request_id for c in self.parent.children if not c.finished]
        if unfinished:
            self.client.abort(unfinished)
        self.client.close(ids)
