"""Reading `kvray run --input`: a file, a directory of `*.jsonl` shards, a glob, or stdin (`-`,
`/dev/stdin`), streamed line by line with bounded memory.

Every line is handled in isolation: whatever goes wrong while decoding, parsing, validating or
tokenizing it (invalid UTF-8, a 5,000-digit integer, JSON nested 100,000 deep, a lone surrogate)
becomes that line's error Item, and the next line goes on. A line longer than the model could ever
take is refused without being held whole, and a text prompt with more characters than max_model_len
tokens could span is refused before it is tokenized.

Each file's format is detected from its first non-blank line: OpenAI Batch API lines (`custom_id`,
see cluster/job/openai_batch.py) or kvray's own `{"id"?, "prompt" | "prompt_token_ids", sampling fields?}`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterator

from cluster.client.sampling_defaults import chat_max_tokens
from cluster.job.keys import KeySet
from cluster.job.line_check import LineError, check_text
from cluster.job.openai_batch import BatchLineError, parse_batch_record
from kvcore.request import RequestValidationError, SamplingParams, check_token_ids

PROMPT_KEYS = ("prompt", "prompt_token_ids")
STDIN_NAMES = ("-", "/dev/stdin")
_READ_CHUNK = 1 << 20


class JobError(RuntimeError):
    """The job cannot run (input missing, output unwritable); the message names the path."""


@dataclass
class Item:
    """One input line, ready to submit (prompt_token_ids and sampling set) or failed (error set)."""

    line: int
    id: str | None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | None = None
    error: str | None = None
    file: str | None = None  # the shard's name when the input has several
    fmt: str = "kvray"  # "kvray" | "openai"
    skip: bool = False  # already answered in the output file
    batch: dict[str, Any] = field(default_factory=dict)  # OpenAI lines: custom_id, url, model


@dataclass(frozen=True)
class Shard:
    path: str  # "-" for stdin
    label: str | None  # None for a single-file input: ids and records stay as before

    @property
    def is_stdin(self) -> bool:
        return self.path in STDIN_NAMES


@dataclass
class Limits:
    max_model_len: int | None = None
    max_token_chars: int = 64  # the longest token's text: a bound on characters per token

    @property
    def max_prompt_chars(self) -> int | None:
        return None if self.max_model_len is None else self.max_model_len * self.max_token_chars

    @property
    def max_line_bytes(self) -> int:
        if self.max_model_len is None:
            return 64 << 20
        # A JSON string spends at most 6 bytes a character (\uXXXX); a token id at most 12 ("-2147483648, ").
        return (64 << 10) + self.max_model_len * max(12, 6 * self.max_token_chars)


def max_token_chars(tokenizer: Any) -> int:
    """The longest vocabulary entry, in characters: no token's text is longer (byte-level BPE keys
    spell each byte with one character)."""
    inner = getattr(tokenizer, "_tok", None)
    try:
        vocab = inner.get_vocab(with_added_tokens=True) if inner is not None else None
    except Exception:  # noqa: BLE001 - an unusual tokenizer: fall back to a generous bound
        vocab = None
    return max(1, max(map(len, vocab), default=1)) if vocab else 64


# ---- which files ----------------------------------------------------------------------------------
def resolve_shards(spec: str) -> list[Shard]:
    """--input -> its shards, in a stable order; a JobError names what is wrong."""
    if spec in STDIN_NAMES:
        return [Shard(spec, None)]
    if os.path.isdir(spec):
        paths = sorted(p for p in glob.glob(os.path.join(spec, "**", "*.jsonl"), recursive=True) if os.path.isfile(p))
        if not paths:
            raise JobError(f"--input {spec!r}: a directory without any *.jsonl file")
        return [Shard(p, os.path.relpath(p, spec)) for p in paths]
    if glob.has_magic(spec):
        paths = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not paths:
            raise JobError(f"--input {spec!r}: the pattern matches no file")
        return [Shard(p, p) for p in paths] if len(paths) > 1 else [Shard(paths[0], None)]
    if not os.path.exists(spec):
        raise JobError(f"--input {spec!r}: no such file")
    return [Shard(spec, None)]


def count_lines(shards: list[Shard]) -> int | None:
    """Lines in all shards (the progress bar's total; blank lines count too); None for a stream."""
    total = 0
    for s in shards:
        if s.is_stdin or not os.path.isfile(s.path):
            return None
        with open(s.path, "rb") as f:
            last = b"\n"
            for chunk in iter(lambda: f.read(_READ_CHUNK), b""):
                total += chunk.count(b"\n")
                last = chunk[-1:]
            total += last != b"\n"
    return total


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes or None when longer than limit, length); never holds more than limit bytes."""
    n = 0
    while True:
        raw = f.readline(limit + 2)
        if not raw:
            return
        n += 1
        size = len(raw)
        if size > limit + 1 or (size == limit + 1 and not raw.endswith(b"\n")):
            while not raw.endswith(b"\n"):
                raw = f.readline(_READ_CHUNK)
                if not raw:
                    break
                size += len(raw)
            yield n, None, size
        else:
            yield n, raw, size


def _open(shard: Shard) -> BinaryIO:
    if shard.path == "-":
        return sys.stdin.buffer
    try:
        return open(shard.path, "rb")
    except OSError as e:
        raise JobError(f"--input {shard.path!r}: cannot be read ({e.strerror or e})") from None


def detect_format(raw: bytes) -> str:
    try:
        rec = json.loads(raw)
        return "openai" if isinstance(rec, dict) and "custom_id" in rec else "kvray"
    except (ValueError, RecursionError):  # an unparseable first line: look for the key itself
        return "openai" if b'"custom_id"' in raw else "kvray"


# ---- lines -> items ---------------------------------------------------------------------------------
class InputReader:
    """Streams Items from the shards: parsed, validated, tokenized, or failed alone."""

    def __init__(
        self,
        shards: list[Shard],
        default_sp: SamplingParams,
        tokenizer: Any = None,
        limits: Limits | None = None,
        done: KeySet | None = None,
        render_chat: Callable[[list[Any]], str] | None = None,
        chat_to_context_end: bool = True,
    ) -> None:
        self.shards = shards
        # An OpenAI chat line without max_tokens runs to the end of the context, as kvray serve answers it;
        # False when the caller set the default max_tokens itself (kvray run --max-tokens).
        self.chat_to_context_end = chat_to_context_end
        self.default_sp = default_sp
        self.tokenizer = tokenizer
        self.limits = limits or Limits()
        self.done = done if done is not None else KeySet()
        self.render_chat = render_chat
        self.seen = KeySet()

    def __iter__(self) -> Iterator[Item]:
        for shard in self.shards:
            f = _open(shard)
            try:
                fmt = None
                for n, raw, size in _lines(f, self.limits.max_line_bytes):
                    if raw is not None and not raw.strip():
                        continue
                    if fmt is None:
                        fmt = detect_format(raw) if raw is not None else "kvray"
                    yield self._item(shard, fmt, n, raw, size)
            finally:
                if f is not sys.stdin.buffer:
                    f.close()

    def _item(self, shard: Shard, fmt: str, n: int, raw: bytes | None, size: int) -> Item:
        where = f"line {n}" if shard.label is None else f"{shard.label} line {n}"
        item = Item(n, None, file=shard.label, fmt=fmt)
        try:
            if raw is None:
                item.error = (
                    f"{where}: {size:,} bytes, longer than any prompt the model can take "
                    f"({self.limits.max_line_bytes:,} bytes at max_model_len={self.limits.max_model_len})"
                )
                return item
            rec = _decode(where, raw)
            if fmt == "openai":
                item.batch = {"custom_id": _usable_custom_id(rec)}  # its error line names it too
                fields = parse_batch_record(where, rec, self.render_chat)
                item.batch = {k: fields.pop(k) for k in ("custom_id", "url", "model")}
                item.id = item.batch["custom_id"]  # checked: a valid, printable string
            else:
                default_id = str(n) if shard.label is None else f"{shard.label}:{n}"
                item.id = _readable_id(rec, default_id)  # its error record keeps it, whichever field is wrong
                fields = _kvray_fields(where, rec)
                rid = fields.pop("id", default_id)
                _check_id(where, rid)
                item.id = rid
            if item.id in self.seen:
                dup, item.id = item.id, None
                item.error = f"{where}: duplicate id {dup!r} (first used earlier in the input); ids must be unique"
                return item
            self.seen.add(item.id)
            if item.id in self.done:
                item.skip = True
                return item
            self._prepare(where, item, fields)
        except (LineError, BatchLineError) as e:
            item.error = str(e)
        except Exception as e:  # noqa: BLE001 - whatever breaks on one line fails that line alone
            item.error = f"{where}: {type(e).__name__}: {e}"
        return item

    def _prepare(self, where: str, item: Item, fields: dict[str, Any]) -> None:
        overrides = fields.pop("sampling")
        try:
            item.sampling = (
                SamplingParams(**{**self.default_sp.__dict__, **overrides}) if overrides else self.default_sp
            )
        except (RequestValidationError, TypeError, ValueError) as e:
            raise LineError(f"{where}: {e}") from None
        item.prompt, ids = fields.get("prompt"), fields.get("prompt_token_ids")
        if ids is not None:
            item.prompt_token_ids = ids
            return
        if self.tokenizer is None:
            raise LineError(f"{where}: text prompt, but the model has no tokenizer.json here")
        assert item.prompt is not None  # the line parser demands exactly one of prompt, prompt_token_ids
        cap = self.limits.max_prompt_chars
        if cap is not None and len(item.prompt) > cap:
            raise LineError(
                f"{where}: prompt has {len(item.prompt):,} characters, more than "
                f"max_model_len={self.limits.max_model_len} tokens can hold (a token spans at most "
                f"{self.limits.max_token_chars} characters here); refused before tokenizing"
            )
        item.prompt_token_ids = (
            encode_rendered_chat(self.tokenizer, item.prompt)
            if fields.get("chat")
            else self.tokenizer.encode(item.prompt)
        )
        if (
            fields.get("chat")
            and self.chat_to_context_end
            and "max_tokens" not in overrides
            and self.limits.max_model_len is not None
        ):
            # As `kvray serve` answers the same request (cluster/client/sampling_defaults.py).
            budget = chat_max_tokens(self.limits.max_model_len, len(item.prompt_token_ids))
            item.sampling = dataclasses.replace(item.sampling, max_tokens=budget)


def encode_rendered_chat(tokenizer: Any, text: str) -> list[int]:
    """A rendered chat template already holds its special tokens: add none (where the tokenizer can)."""
    import inspect

    if "add_special_tokens" in inspect.signature(tokenizer.encode).parameters:
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def _decode(where: str, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise LineError(f"{where}: not valid JSON here (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise LineError(f"{where}: not valid JSON here ({str(e).splitlines()[0]})") from None


def _kvray_fields(where: str, rec: Any) -> dict[str, Any]:
    """kvray's line format -> {"id"?, "prompt" | "prompt_token_ids", "sampling": {...}}."""
    if not isinstance(rec, dict):
        raise LineError(f"{where}: must be a JSON object, got {type(rec).__name__}")
    sampling_keys = tuple(SamplingParams.__dataclass_fields__)
    out: dict[str, Any] = {}
    if "id" in rec:
        rid = rec["id"]
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
            raise LineError(f"{where}: id={_short(rid)} must be a non-empty string or an integer")
        out["id"] = str(rid)
    unknown = sorted(set(rec) - {"id", *PROMPT_KEYS, *sampling_keys})
    present = [k for k in PROMPT_KEYS if k in rec]
    if unknown:
        raise LineError(
            f"{where}: unknown field(s) {_short(unknown)}; allowed: id, prompt | prompt_token_ids, "
            f"and sampling fields {list(sampling_keys)}"
        )
    if len(present) != 1:
        raise LineError(f"{where}: needs exactly one of 'prompt' or 'prompt_token_ids', got {present}")
    if "prompt" in rec:
        out["prompt"] = check_text(where, "prompt", rec["prompt"])
    else:
        err = check_token_ids(f"{where}: prompt_token_ids", rec["prompt_token_ids"])  # the vocabulary: the engine's
        if err is not None:
            raise LineError(err)
        out["prompt_token_ids"] = rec["prompt_token_ids"]
    out["sampling"] = {k: rec[k] for k in sampling_keys if k in rec}
    return out


def _check_id(where: str, rid: str) -> None:
    check_text(where, "id", rid)
    if not rid.isprintable():
        raise LineError(f"{where}: id={_short(rid)} must be printable (no control characters)")


def _usable_custom_id(rec: Any) -> str | None:
    cid = rec.get("custom_id") if isinstance(rec, dict) else None
    return cid if isinstance(cid, str) and _printable(cid) else None


def _readable_id(rec: Any, default_id: str) -> str | None:
    """A kvray line's id as its record will carry it, when it has one (a non-empty printable string or an
    integer; the line's own number when it has no `id`); read before any other field is checked, so that
    the line's error record names it."""
    if not isinstance(rec, dict):
        return None
    if "id" not in rec:
        return default_id
    rid = rec["id"]
    if isinstance(rid, int) and not isinstance(rid, bool):
        return str(rid)
    return rid if isinstance(rid, str) and _printable(rid) else None


def _printable(text: str) -> bool:
    if not text or not text.isprintable():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def read_items(
    path: str, default_sp: SamplingParams, tokenizer: Any = None, limits: Limits | None = None
) -> InputReader:
    """The items of one --input (file, directory, glob or stdin)."""
    return InputReader(resolve_shards(path), default_sp, tokenizer, limits)
