"""The batch job behind `kvray run`: read prompts (JSON lines), stream them through the engines, append
each finished output to the output file as one whole JSON line (flushed), and summarise the run.

Resumable: each output record carries the input's `id` (from the input, else its line number) and
`line`; a rerun with the same output file skips what is already answered. Records of lines that
cannot be parsed have `"id": null` and are skipped by line number. A half-written last line (the job
was killed mid-write) is cut off before appending. Requests lost to an engine failure are not
written, so a resubmitted job answers them.
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from actors.driver import RequestSpec
from cluster.config import EngineConfig
from cluster.engines import EngineFailure, EngineGroup, Finished
from kvcore.request import RequestValidationError, SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")
SAMPLING_KEYS = tuple(SamplingParams.__dataclass_fields__)


class JobError(RuntimeError):
    """The job cannot run (input missing, output unwritable); the message names the path."""


@dataclass
class Item:
    line: int
    id: str | None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | None = None
    error: str | None = None


@dataclass
class JobStats:
    requests: int = 0
    completed: int = 0
    errors: int = 0
    skipped: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


# ---- input ---------------------------------------------------------------------------------------
def parse_line(line_no: int, text: str, default_sp: SamplingParams) -> Item:
    """One input line -> an Item (with `error` set when the line breaks a rule)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        return Item(line_no, None, error=f"line {line_no}: not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(rec, dict):
        return Item(line_no, None, error=f"line {line_no}: must be a JSON object, got {type(rec).__name__}")
    rid = rec.get("id", line_no)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return Item(line_no, None, error=f"line {line_no}: id={rid!r} must be a non-empty string or an integer")
    item = Item(line_no, str(rid))
    unknown = sorted(set(rec) - {"id", *PROMPT_KEYS, *SAMPLING_KEYS})
    present = [k for k in PROMPT_KEYS if k in rec]
    if unknown:
        item.error = (f"line {line_no}: unknown field(s) {unknown}; allowed: id, prompt | prompt_token_ids, "
                      f"and sampling fields {list(SAMPLING_KEYS)}")
    elif len(present) != 1:
        item.error = f"line {line_no}: needs exactly one of 'prompt' or 'prompt_token_ids', got {present}"
    elif "prompt" in rec and not isinstance(rec["prompt"], str):
        item.error = f"line {line_no}: prompt must be a string"
    elif "prompt_token_ids" in rec and not _int_list(rec["prompt_token_ids"]):
        item.error = f"line {line_no}: prompt_token_ids must be a list of integers"
    if item.error:
        return item
    item.prompt, item.prompt_token_ids = rec.get("prompt"), rec.get("prompt_token_ids")
    overrides = {k: rec[k] for k in SAMPLING_KEYS if k in rec}
    try:
        item.sampling = SamplingParams(**{**default_sp.__dict__, **overrides}) if overrides else default_sp
    except (RequestValidationError, TypeError) as e:
        item.error = f"line {line_no}: {e}"
    return item


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def read_items(path: str, default_sp: SamplingParams) -> Iterator[Item]:
    if not os.path.isfile(path):
        raise JobError(f"--input {path!r}: no such file")
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            item = parse_line(line_no, text, default_sp)
            if item.id is not None and item.id in seen:
                item = Item(line_no, None, error=f"line {line_no}: duplicate id {item.id!r} (first used earlier "
                                                 f"in the input); ids must be unique")
            elif item.id is not None:
                seen.add(item.id)
            yield item


def synthetic_items(n: int, seed: int, vocab_size: int, max_model_len: int) -> Iterator[Item]:
    """A built-in workload: families of prompts sharing prefixes, mixed lengths, greedy and seeded."""
    rng = random.Random(seed)
    families = [[rng.randrange(vocab_size) for _ in range(rng.randint(16, 64))] for _ in range(4)]
    for i in range(n):
        prefix = families[i % len(families)]
        prompt = prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(4, 48))]
        max_tokens = max(1, min(rng.randint(8, 48), max_model_len - len(prompt)))
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True) if i % 2 == 0 else \
            SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=i)
        yield Item(i + 1, f"synthetic-{i}", prompt_token_ids=prompt, sampling=sp)


# ---- output --------------------------------------------------------------------------------------
def load_done(path: str | None) -> tuple[set[str], set[int]]:
    """Ids (and, for unparseable lines, line numbers) already answered in an existing output file."""
    ids: set[str] = set()
    lines: set[int] = set()
    if not path or not os.path.exists(path):
        return ids, lines
    _cut_partial_line(path)
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                continue
            if rec.get("id") is not None:
                ids.add(str(rec["id"]))
            elif isinstance(rec.get("line"), int):
                lines.add(rec["line"])
    return ids, lines


def _cut_partial_line(path: str) -> None:
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def check_output_writable(path: str | None) -> None:
    """Fail before any engine starts when the output file cannot be appended to."""
    f = open_output(path)
    if f is not None:
        f.close()


def open_output(path: str | None):
    if path is None:
        return None
    try:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise JobError(f"--output {path!r}: cannot be written ({_why_unwritable(path, e)})") from None


def _why_unwritable(path: str, e: OSError) -> str:
    # makedirs on a path through a regular file says only "File exists": name the file instead.
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        return f"{parent!r} is a file, not a directory"
    return e.strerror or str(e)


def write_record(f, rec: dict[str, Any]) -> None:
    if f is not None:
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()


# ---- the run -------------------------------------------------------------------------------------
class Job:
    def __init__(self, config: EngineConfig, engines: EngineGroup, tokenizer: Any,
                 output_path: str | None, progress: bool = True) -> None:
        self.config = config
        self.engines = engines
        self.tokenizer = tokenizer
        self.output_path = output_path
        self.progress = progress
        self.stats = JobStats()
        self.window = max(1, 2 * config.scheduler.max_num_seqs * config.parallel.data_parallel_size)

    def run(self, items: Iterator[Item]) -> JobStats:
        done_ids, done_lines = load_done(self.output_path)
        out = open_output(self.output_path)
        bar = _bar(self.progress)
        live: dict[str, tuple[Item, list[int]]] = {}
        t0 = time.monotonic()
        try:
            pending = iter(items)
            exhausted = False
            while not exhausted or live:
                while not exhausted and len(live) < self.window:
                    item = next(pending, None)
                    if item is None:
                        exhausted = True
                        break
                    if (item.id in done_ids) if item.id is not None else (item.line in done_lines):
                        self.stats.skipped += 1
                        continue
                    self._submit(item, live, out, bar)
                self._drain(live, out, bar)
        finally:
            self.stats.wall_s = time.monotonic() - t0
            if out is not None:
                out.close()
            if bar is not None:
                bar.close()
        return self.stats

    def _submit(self, item: Item, live: dict, out, bar) -> None:
        self.stats.requests += 1
        if item.error is None and item.prompt_token_ids is None:
            if self.tokenizer is None:
                item.error = f"line {item.line}: text prompt, but the model has no tokenizer.json here"
            else:
                item.prompt_token_ids = self.tokenizer.encode(item.prompt)
        if item.error is not None:
            self._write_error(item, item.error, out, bar)
            return
        rid = item.id
        live[rid] = (item, [])
        err = self.engines.submit([RequestSpec(rid, item.prompt_token_ids, item.sampling)]).get(rid)
        if err is not None:
            del live[rid]
            if self.engines.fatal is not None:
                # Refused because its replica is down: not this request's fault, so no record is
                # written and a resubmitted job answers it.
                raise EngineFailure(self.engines.fatal)
            self._write_error(item, err, out, bar)

    def _drain(self, live: dict, out, bar) -> None:
        if not live:
            return
        for got in self.engines.poll(timeout_s=0.5):
            o = got.output if isinstance(got, Finished) else got
            entry = live.get(o.request_id)
            if entry is None:
                continue
            entry[1].extend(o.new_token_ids)
            if isinstance(got, Finished):
                del live[o.request_id]
                self._write_done(entry[0], entry[1], got, out, bar)
        if self.engines.fatal is not None:
            raise EngineFailure(self.engines.fatal)

    def _write_done(self, item: Item, tokens: list[int], got: Finished, out, bar) -> None:
        o, t = got.output, got.timing
        if o.finish_reason == "error":
            self._write_error(item, o.error or "error", out, bar)
            return
        s = self.stats
        s.completed += 1
        s.input_tokens += len(item.prompt_token_ids)
        s.output_tokens += len(tokens)
        if t is not None and t.ttft_s is not None:
            s.ttft_s.append(t.ttft_s)
            if len(tokens) > 1:
                s.tpot_s.append((t.e2e_s - t.ttft_s) / (len(tokens) - 1))
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else None
        write_record(out, {"id": item.id, "line": item.line, "prompt_tokens": len(item.prompt_token_ids),
                           "output_token_ids": tokens, "text": text, "finish_reason": o.finish_reason,
                           "error": None, "num_cached_tokens": o.num_cached_tokens,
                           "ttft_s": None if t is None else t.ttft_s, "e2e_s": None if t is None else t.e2e_s})
        if bar is not None:
            bar.update(1)

    def _write_error(self, item: Item, message: str, out, bar) -> None:
        self.stats.errors += 1
        write_record(out, {"id": item.id, "line": item.line, "output_token_ids": [], "text": None,
                           "finish_reason": "error", "error": message})
        if bar is not None:
            bar.update(1)


def _bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc="kvray run", unit="req", mininterval=0.5)


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
        "requests": stats.requests, "completed": stats.completed, "errors": stats.errors,
        "skipped_already_done": stats.skipped,
        "input_tokens": stats.input_tokens, "output_tokens": stats.output_tokens,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(stats.output_tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_ms": _ms(percentile(stats.ttft_s, 50)), "ttft_p99_ms": _ms(percentile(stats.ttft_s, 99)),
        "tpot_p50_ms": _ms(percentile(stats.tpot_s, 50)), "tpot_p99_ms": _ms(percentile(stats.tpot_s, 99)),
        "preemptions": sum(int(s.get("num_preemptions", 0)) for s in engine_stats),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "peak_kv_cache_usage": round(max((float(s.get("peak_kv_cache_usage", 0.0)) for s in engine_stats),
                                         default=0.0), 4),
        "worker_restarts": sum(int(s.get("worker_restarts", 0)) for s in engine_stats),
        "data_parallel_size": len(engine_stats),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def format_summary(summary: dict[str, Any]) -> str:
    width = max(len(k) for k in summary)
    return "\n".join(f"{k:<{width}}  {'-' if v is None else v}" for k, v in summary.items())
