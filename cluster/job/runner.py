"""The batch job behind `kvray run`: stream input lines (cluster/job/input.py) through the engines, a
bounded window at a time, append each finished request to the output file as one whole JSON line
(cluster/job/output.py; OpenAI Batch lines for OpenAI Batch input, cluster/job/openai_batch.py), and
summarise the run.

Resumable: a rerun with the same output file skips every id that already has a successful record and
answers the rest, earlier failures included. Requests lost to an engine failure are not written, so a
rerun answers them. Nothing grows with the input: the job holds the window's requests, and one
8-byte digest per id for resume and duplicate checks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from actors.messages import RequestSpec
from cluster.client.output_processor import OutputProcessor, ParentRequest
from cluster.client.stream import ProcessedStream
from cluster.config import EngineConfig
from cluster.job.input import InputReader, Item, JobError, Limits, max_token_chars, read_items
from cluster.job.openai_batch import batch_error, batch_output
from cluster.job.output import OutputFile, load_done
from cluster.job.records import kvray_record
from cluster.outputs import RequestOutput
from cluster.replicas.engine_group import EngineFailure, EngineGroup
from kvcore.request import SamplingParams

__all__ = [
    "Job",
    "JobError",
    "JobStats",
    "Item",
    "read_items",
    "load_done",
    "synthetic_items",
    "summarize",
    "format_summary",
]

NUM_SAMPLES = 3


@dataclass
class JobStats:
    requests: int = 0
    completed: int = 0
    errors: int = 0
    skipped: int = 0
    earlier_errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    samples: list[tuple[str, str]] = field(default_factory=list)
    output_path: str | None = None


def synthetic_items(n: int, seed: int, vocab_size: int, max_model_len: int) -> Iterator[Item]:
    """A built-in workload: families of prompts sharing prefixes, mixed lengths, greedy and seeded."""
    rng = random.Random(seed)
    families = [[rng.randrange(vocab_size) for _ in range(rng.randint(16, 64))] for _ in range(4)]
    for i in range(n):
        prefix = families[i % len(families)]
        prompt = prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(4, 48))]
        max_tokens = max(1, min(rng.randint(8, 48), max_model_len - len(prompt)))
        sp = (
            SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            if i % 2 == 0
            else SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=i)
        )
        yield Item(i + 1, f"synthetic-{i}", prompt_token_ids=prompt, sampling=sp)


# ---- the run -------------------------------------------------------------------------------------
class Job(ProcessedStream):
    def __init__(
        self,
        config: EngineConfig,
        engines: EngineGroup,
        tokenizer: Any,
        output_path: str | None,
        progress: bool = True,
        total: int | None = None,
        output: OutputFile | None = None,
    ) -> None:
        # Detokenization, stop strings, n samples and logprobs, exactly as LLM.generate makes them.
        super().__init__(engines, OutputProcessor(tokenizer))
        self.config = config
        self.tokenizer = tokenizer
        self.output_path = output_path
        self.out = output
        self.progress = progress
        self.total = total
        self.stats = JobStats(output_path=output_path)
        self.window = max(1, 2 * config.scheduler.max_num_seqs * config.parallel.data_parallel_size)
        self.live: dict[str, Item] = {}
        self.bar: Any = None
        self._items: Iterator[Item] = iter(())
        self._done: Any = None
        self._exhausted = False

    def run(self, items: Iterable[Item]) -> JobStats:
        """Every item ends as one record (or a skip); raises EngineFailure / JobError (a failed write)
        with everything written so far whole."""
        if self.out is None and self.output_path is not None:
            self.out = OutputFile(self.output_path)
        self._done = self.out.done if self.out is not None else None
        self.stats.earlier_errors = self.out.earlier_errors if self.out is not None else 0
        if isinstance(items, InputReader):
            self._configure(items, self._done)
        self.bar = _Bar(self.progress, self.total)
        t0 = self.bar.t0  # one clock for the bar's tok/s and the summary's
        try:
            self._items, self._exhausted = iter(items), False
            self.loop()
        finally:
            self.stats.wall_s = time.monotonic() - t0
            self.bar.close(self.stats)
            if self.out is not None:
                self.out.close()
        return self.stats

    def _configure(self, reader: InputReader, done: Any) -> None:
        if done is not None:
            reader.done = done
        if reader.tokenizer is None:
            reader.tokenizer = self.tokenizer
        if reader.render_chat is None and self.tokenizer is not None:
            from cluster.job.openai_batch import make_chat_renderer

            reader.render_chat = make_chat_renderer(self.tokenizer)
        mml = self.engines.info.get("max_model_len") if self.engines.infos else None
        if reader.limits.max_model_len is None and mml:
            reader.limits = Limits(int(mml), max_token_chars(self.tokenizer) if self.tokenizer else 64)

    # ---- the stream's hooks (cluster/client/stream.py) ----------------------------------------------------
    def due(self) -> list[RequestSpec] | None:
        """The next items up to the window; skips and bad lines are recorded on the way."""
        batch: list[Item] = []
        done = self._done
        while not self._exhausted and len(self.live) + len(batch) < self.window:
            item = next(self._items, None)
            if item is None:
                self._exhausted = True
            elif item.skip or (done is not None and item.id is not None and item.id in done):
                self.stats.skipped += 1
                self.bar.update(self.stats, 1)
            elif item.error is not None:
                self.stats.requests += 1
                self._write_error(item, item.error)
            else:
                batch.append(item)
        if not batch and self._exhausted:
            return None
        specs: list[RequestSpec] = []
        for item in batch:
            # A batch holds only items ready to submit: id, tokens and sampling set (see Item).
            assert item.id is not None and item.prompt_token_ids is not None and item.sampling is not None
            self.stats.requests += 1
            self.live[item.id] = item
            _, subs = self.processor.add_request(item.id, item.prompt, item.prompt_token_ids, item.sampling)
            specs.extend(RequestSpec(rid, item.prompt_token_ids, sp) for rid, sp in subs)
        return specs

    def in_flight(self) -> int:
        return len(self.live)

    def refused(self, errors: dict[str, str]) -> None:
        if errors and self.engines.fatal is not None:
            # Refused because its replica is down: not these requests' fault, so no record is written
            # and a rerun answers them.
            raise EngineFailure(self.engines.fatal)
        super().refused(errors)

    def finished(self, parent: ParentRequest, refused: bool) -> None:
        item = self.live.pop(parent.request_id, None)
        if item is not None:
            self._write_output(item, parent.output(), status=400 if refused else 500)

    def _write_output(self, item: Item, out: RequestOutput, status: int) -> None:
        if out.error is not None:
            self._write_error(item, out.error, status=status)
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        try:
            rec = batch_output(item, out) if item.fmt == "openai" else kvray_record(item, out)
            data = self.out.encode(rec) if self.out is not None else b""
        except Exception as e:  # noqa: BLE001 - a record that cannot be written fails its line alone
            self._write_error(item, f"line {item.line}: the output cannot be written ({type(e).__name__}: {e})")
            return
        if self.out is not None:
            self.out.write(data)
        s, t = self.stats, out.metrics
        s.completed += 1
        assert item.id is not None and item.prompt_token_ids is not None  # it was submitted
        s.input_tokens += len(item.prompt_token_ids)
        s.output_tokens += tokens
        if t is not None and t.ttft_s is not None and len(s.ttft_s) < 100_000:  # bounded: a sample suffices
            s.ttft_s.append(t.ttft_s)
            n = len(out.outputs[0].token_ids)
            if n > 1:
                s.tpot_s.append((t.e2e_s - t.ttft_s) / (n - 1))
        if len(s.samples) < NUM_SAMPLES and self.tokenizer is not None:
            s.samples.append((item.id, out.outputs[0].text))
        self.bar.update(s, 1)

    def _write_error(self, item: Item, message: str, status: int = 400) -> None:
        self.stats.errors += 1
        # The message may quote the line's own bad text (a lone surrogate): keep it writable.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        rid = item.id.encode("utf-8", "backslashreplace").decode("utf-8") if item.id is not None else None
        if item.fmt == "openai":
            rec = batch_error(item, message, status)
        else:
            rec = {
                "id": rid,
                "line": item.line,
                "output_token_ids": [],
                "text": None,
                "finish_reason": "error",
                "error": message,
            }
            if item.file is not None:
                rec["file"] = item.file.encode("utf-8", "backslashreplace").decode("utf-8")
        if self.out is not None:
            self.out.write(self.out.encode(rec))
        self.bar.update(self.stats, 1)


class _Bar:
    """tqdm with the total (when the input could be counted), ETA, output tok/s and errors so far."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        self.bar = None
        self.t0 = time.monotonic()
        self.last = 0.0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="kvray run", unit="req", mininterval=0.5, dynamic_ncols=True)

    def update(self, stats: JobStats, n: int) -> None:
        if self.bar is None:
            return
        self.bar.update(n)
        now = time.monotonic()
        if now - self.last >= 0.5:
            self.last = now
            self._postfix(stats, now - self.t0, refresh=False)

    def _postfix(self, stats: JobStats, wall_s: float, refresh: bool) -> None:
        assert self.bar is not None
        self.bar.set_postfix_str(f"{output_tok_per_s(stats, wall_s):.0f} tok/s, {stats.errors} errors", refresh=refresh)

    def close(self, stats: JobStats | None = None) -> None:
        if self.bar is not None:
            if stats is not None:  # the last word: the summary's numbers (a postfix may be 0.5 s old)
                self._postfix(stats, stats.wall_s, refresh=True)
            self.bar.close()


def output_tok_per_s(stats: JobStats, wall_s: float) -> float:
    """Output tokens per second of wall time: the progress bar's and the summary's one formula."""
    return stats.output_tokens / wall_s if wall_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(stats: JobStats, engine_stats: list[dict[str, Any]]) -> dict[str, Any]:
    wall = stats.wall_s
    queries = sum(int(s.get("prefix_cache_queries", 0)) for s in engine_stats)
    hits = sum(int(s.get("prefix_cache_hits", 0)) for s in engine_stats)
    return {
        "output": stats.output_path,
        "requests": stats.requests,
        "completed": stats.completed,
        "errors": stats.errors,
        "skipped_already_done": stats.skipped,
        "earlier_error_records": stats.earlier_errors,
        "input_tokens": stats.input_tokens,
        "output_tokens": stats.output_tokens,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(output_tok_per_s(stats, wall), 2) if wall > 0 else None,
        "ttft_p50_ms": _ms(percentile(stats.ttft_s, 50)),
        "ttft_p99_ms": _ms(percentile(stats.ttft_s, 99)),
        "tpot_p50_ms": _ms(percentile(stats.tpot_s, 50)),
        "tpot_p99_ms": _ms(percentile(stats.tpot_s, 99)),
        "preemptions": sum(int(s.get("num_preemptions", 0)) for s in engine_stats),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "peak_kv_cache_usage": round(
            max((float(s.get("peak_kv_cache_usage", 0.0)) for s in engine_stats), default=0.0), 4
        ),
        "worker_restarts": sum(int(s.get("worker_restarts", 0)) for s in engine_stats),
        "driver_restarts": sum(int(s.get("driver_restarts", 0)) for s in engine_stats),
        "requests_moved": sum(int(s.get("requests_moved_away", 0)) for s in engine_stats),
        "data_parallel_size": len(engine_stats),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def format_summary(summary: dict[str, Any]) -> str:
    width = max(len(k) for k in summary)
    return "\n".join(f"{k:<{width}}  {'-' if v is None else v}" for k, v in summary.items())
