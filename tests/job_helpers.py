"""Helpers for the batch-job tests: an in-process engine group with EngineGroup's client interface
(submit, poll, fatal, info), so the job's reading, writing and resume logic is tested in milliseconds;
the end-to-end runs through Ray are in test_job_cli.py, test_resume.py and test_job_submit.py.

Its "model" answers request r with max_tokens tokens (sum(prompt) + i) % 256, so every output can be
checked; it refuses what the real driver refuses (an empty prompt, ids beyond the vocabulary, a prompt
over max_model_len), and one poll may hand back a request's tokens in two pieces."""

from __future__ import annotations

from typing import Any

from cluster.replicas.engine_group import EngineFailure
from kvcore.messages import EngineCoreOutput, RequestTiming

VOCAB = 260
MAX_MODEL_LEN = 64


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [(sum(prompt) + i) % 256 for i in range(max_tokens)]


class FakeEngines:
    def __init__(self, fail_after: int | None = None) -> None:  # fail_after: finished requests, then replica 0 dies
        self.infos = [{"max_model_len": MAX_MODEL_LEN, "vocab_size": VOCAB}]
        self.fatal: str | None = None
        self.open: dict[str, Any] = {}
        self.submitted: list[str] = []
        self.max_open = 0
        self.finished = 0
        self.aborted: list[str] = []
        self.fail_after = fail_after

    @property
    def info(self) -> dict[str, Any]:
        return self.infos[0]

    def submit(self, specs: list[Any]) -> dict[str, str]:
        errors = {}
        for s in specs:
            ids = s.prompt_token_ids
            if not ids:
                errors[s.request_id] = "prompt_token_ids is empty"
            elif any(t < 0 or t >= VOCAB for t in ids):
                errors[s.request_id] = f"a token id is outside the vocabulary [0, {VOCAB})"
            elif len(ids) > MAX_MODEL_LEN:
                errors[s.request_id] = f"prompt of {len(ids)} tokens exceeds max_model_len={MAX_MODEL_LEN}"
            else:
                assert s.request_id not in self.open, "a request id submitted twice while open"
                self.open[s.request_id] = s
                self.submitted.append(s.request_id)
        self.max_open = max(self.max_open, len(self.open))
        return errors

    def poll(self, timeout_s: float = 1.0) -> list[Any]:
        if self.fail_after is not None and self.finished >= self.fail_after:
            self.fatal = "engine replica 0 is down: injected"
            return []
        out: list[Any] = []
        for rid, s in list(self.open.items())[:4]:
            toks = expected_tokens(s.prompt_token_ids, s.sampling_params.max_tokens)
            half = len(toks) // 2
            out.append(EngineCoreOutput(rid, toks[:half]))
            timing = RequestTiming(0.01, 0.02, len(s.prompt_token_ids), len(toks))
            out.append(EngineCoreOutput(rid, toks[half:], True, "length", timing=timing))
            del self.open[rid]
            self.finished += 1
        return out

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for rid in request_ids:
            self.open.pop(rid, None)

    def stats(self) -> list[dict[str, Any]]:
        return [{}]


__all__ = ["FakeEngines", "expected_tokens", "EngineFailure", "MAX_MODEL_LEN"]
