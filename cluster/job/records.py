"""kvray's own output record for one input line, from the RequestOutput that the client's
OutputProcessor made (detokenized text, stop strings applied, n samples, logprobs)."""

from __future__ import annotations

from typing import Any

from cluster.outputs import CompletionOutput, RequestOutput


def kvray_record(item: Any, out: RequestOutput) -> dict[str, Any]:
    first, t = out.outputs[0], out.metrics
    rec: dict[str, Any] = {
        "id": item.id,
        "line": item.line,
        "prompt_tokens": len(item.prompt_token_ids),
        **completion_fields(first),
        "error": None,
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": None if t is None else t.ttft_s,
        "e2e_s": None if t is None else t.e2e_s,
    }
    if len(out.outputs) > 1:
        rec["outputs"] = [{"index": c.index, **completion_fields(c)} for c in out.outputs]
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = [None if d is None else _top(d) for d in out.prompt_logprobs]
    if item.file is not None:
        rec["file"] = item.file
    return rec


def completion_fields(c: CompletionOutput) -> dict[str, Any]:
    out: dict[str, Any] = {
        "output_token_ids": list(c.token_ids),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if c.logprobs is not None:
        out["logprobs"] = [_top(d) for d in c.logprobs]
        out["cumulative_logprob"] = c.cumulative_logprob
    return out


def _top(d: dict[int, Any]) -> list[dict[str, Any]]:
    """{token id: Logprob} -> a list (JSON keys would turn the ids into strings)."""
    return [
        {"token_id": tid, "logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token} for tid, lp in d.items()
    ]
