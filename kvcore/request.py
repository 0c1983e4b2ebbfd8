"""Request, SamplingParams and RequestStatus: the scheduler's view of one generation."""

from __future__ import annotations

import enum
import reprlib
import time
from dataclasses import dataclass, field
from typing import Any


class RequestValidationError(ValueError):
    """A request field breaks a rule; the message names the field and the rule."""


# The ranges below are what the worker's buffers hold: token ids and top_k go into int32 arrays,
# a seed into a torch.Generator (int64), temperatures into float32. A value past them would pass here
# and then fail (OverflowError, NaN logits) inside a worker, taking the whole replica down.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKENS_LIMIT = 2**24  # longer than any model's context; max_model_len caps it further
MAX_TEMPERATURE = 100.0  # past this the distribution is uniform to float32 precision anyway
GREEDY_TEMPERATURE = 1e-5  # below this a temperature is greedy (vLLM's _SAMPLING_EPS): 1/t overflows
MAX_STOP_TOKEN_IDS = 1024
MAX_ID_CHARS = 512  # request ids land in output records and logs
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_PENALTY = 2.0  # presence/frequency penalties in [-2, 2], as OpenAI and vLLM
MAX_REPETITION_PENALTY = 100.0  # > 0; past this it only flips signs of far-gone logits
MAX_N = 1024  # samples per prompt (each is an engine request)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024  # each new token scans the text's tail for every one
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_LOGIT_BIAS_TOKENS = 1024  # vLLM's cap on logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # more than any vocabulary: the worker keeps a dense row, any length costs the same
MAX_BAD_WORDS = 128  # words; each becomes up to two token sequences, checked every step
MAX_BAD_WORD_TOKENS = 64  # tokens in one bad word's sequence


def _check(cond: bool, field_name: str, value: Any, rule: str) -> None:
    if not cond:
        raise RequestValidationError(f"SamplingParams.{field_name}={short_repr(value)}: {rule}")


class _ShortRepr(reprlib.Repr):
    """reprlib with ints cut by size: repr() of a 5,000-digit int raises (and a list of them is huge)."""

    def repr_int(self, x: int, level: int) -> str:
        return repr(x) if x.bit_length() < 256 else f"<{x.bit_length()}-bit int>"


_REPR = _ShortRepr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 8


_MAX_REPR_CHARS = 200  # nesting multiplies reprlib's per-level limits, so the whole is cut as well


def short_repr(value: Any) -> str:
    """A bounded repr: an error message never carries a whole (possibly huge or nested) value."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not replace the real error
        return f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_REPR_CHARS else text[: _MAX_REPR_CHARS - 3] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_field(sp: Any, name: str, lo: int, hi: int, rule: str) -> None:
    v = getattr(sp, name)
    _check(_is_int(v), name, v, "must be an integer")
    _check(lo <= v <= hi, name, v, rule)


def validate(sp: "SamplingParams") -> None:
    """Every rule of every SamplingParams field; raises RequestValidationError naming the first broken one.

    Called on construction and again by the driver on what it receives: a SamplingParams can be
    changed after construction, and one unpickled from a client never ran __post_init__.
    Comparisons are written so that NaN, infinities and ints too big for a float fail them.
    """
    t = sp.temperature
    _check(_is_number(t), "temperature", t, "must be a number")
    _check(
        0 <= t <= MAX_TEMPERATURE,
        "temperature",
        t,
        f"must be finite and >= 0 and <= {MAX_TEMPERATURE:g} (below {GREEDY_TEMPERATURE:g} is greedy)",
    )
    p = sp.top_p
    _check(_is_number(p), "top_p", p, "must be a number")
    _check(0 < p <= 1, "top_p", p, "must be in (0, 1]")
    _int_field(sp, "top_k", -1, INT32_MAX, f"must be >= -1 (0 or -1 disables top-k) and <= {INT32_MAX}")
    _int_field(sp, "max_tokens", 1, MAX_TOKENS_LIMIT, f"must be >= 1 and <= {MAX_TOKENS_LIMIT}")
    _check(isinstance(sp.ignore_eos, bool), "ignore_eos", sp.ignore_eos, "must be a bool")
    stop = sp.stop_token_ids
    rule = f"must be a list of at most {MAX_STOP_TOKEN_IDS} integers in [0, {INT32_MAX}]"
    _check(isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", stop, rule)
    _check(all(_is_int(i) and 0 <= i <= INT32_MAX for i in stop), "stop_token_ids", stop, rule)
    _int_field(sp, "min_tokens", 0, sp.max_tokens, f"must be >= 0 and <= max_tokens ({sp.max_tokens})")
    s = sp.seed
    _check(
        s is None or (_is_int(s) and INT64_MIN <= s <= INT64_MAX),
        "seed",
        s,
        f"must be None or an integer in [{INT64_MIN}, {INT64_MAX}] (int64)",
    )
    _validate_penalties_and_logprobs(sp)
    _validate_output_fields(sp)
    _validate_logits_processors(sp)


def _validate_penalties_and_logprobs(sp: "SamplingParams") -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        _check(_is_number(v), name, v, "must be a number")
        _check(-MAX_PENALTY <= v <= MAX_PENALTY, name, v, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
    r = sp.repetition_penalty
    _check(_is_number(r), "repetition_penalty", r, "must be a number")
    _check(
        0 < r <= MAX_REPETITION_PENALTY,
        "repetition_penalty",
        r,
        f"must be > 0 and <= {MAX_REPETITION_PENALTY:g} (1 disables it)",
    )
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(sp, name)
        _check(
            v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
            name,
            v,
            f"must be None or an integer in [0, {MAX_LOGPROBS}]",
        )


def _validate_output_fields(sp: "SamplingParams") -> None:
    """n, stop strings and detokenization: handled on the client (cluster/client/output_processor.py)."""
    _int_field(sp, "n", 1, MAX_N, f"must be >= 1 and <= {MAX_N}")
    stop = [sp.stop] if isinstance(sp.stop, str) else [] if sp.stop is None else sp.stop
    rule = (
        f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
        f"{MAX_STOP_CHARS} characters"
    )
    _check(isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_STRINGS, "stop", sp.stop, rule)
    _check(all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop), "stop", sp.stop, rule)
    for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
        _check(isinstance(getattr(sp, name), bool), name, getattr(sp, name), "must be a bool")
    _check(not stop or sp.detokenize, "stop", sp.stop, "stop strings need detokenize=True")


def _validate_logits_processors(sp: "SamplingParams") -> None:
    """min_p, logit_bias, allowed_token_ids, bad_words (vLLM's), and best_of, which vLLM V1 refuses."""
    b = sp.best_of
    _check(
        b is None or (_is_int(b) and b == 1),
        "best_of",
        b,
        "is not supported (vLLM V1 does not support best_of either); leave it None and use n for several samples",
    )
    p = sp.min_p
    _check(_is_number(p), "min_p", p, "must be a number")
    _check(0 <= p <= 1, "min_p", p, "must be in [0, 1] (0 disables it)")
    lb = sp.logit_bias
    rule = (
        f"must be None or a dict of at most {MAX_LOGIT_BIAS_TOKENS} entries, token id (an integer in "
        f"[0, {INT32_MAX}]) -> bias (a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}])"
    )
    _check(lb is None or (isinstance(lb, dict) and len(lb) <= MAX_LOGIT_BIAS_TOKENS), "logit_bias", lb, rule)
    for k, v in (lb or {}).items():
        _check(_is_int(k) and 0 <= k <= INT32_MAX, "logit_bias", {k: v}, rule)
        _check(_is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS, "logit_bias", {k: v}, rule)
    a = sp.allowed_token_ids
    rule = f"must be None or a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} integers in [0, {INT32_MAX}]"
    _check(
        a is None or (isinstance(a, (list, tuple)) and 0 < len(a) <= MAX_ALLOWED_TOKEN_IDS),
        "allowed_token_ids",
        a,
        rule,
    )
    _check(all(_is_int(i) and 0 <= i <= INT32_MAX for i in a or ()), "allowed_token_ids", a, rule)
    w = sp.bad_words
    rule = f"must be None or a list of at most {MAX_BAD_WORDS} non-empty strings of at most {MAX_STOP_CHARS} characters"
    _check(w is None or (isinstance(w, (list, tuple)) and len(w) <= MAX_BAD_WORDS), "bad_words", w, rule)
    _check(all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in w or ()), "bad_words", w, rule)
    ids = sp.bad_words_token_ids
    rule = (
        f"must be None or a list of at most {2 * MAX_BAD_WORDS} non-empty lists of at most {MAX_BAD_WORD_TOKENS} "
        f"token ids in [0, {INT32_MAX}] (the client fills it from bad_words)"
    )
    _check(
        ids is None or (isinstance(ids, (list, tuple)) and len(ids) <= 2 * MAX_BAD_WORDS),
        "bad_words_token_ids",
        ids,
        rule,
    )
    for seq in ids or ():
        _check(
            isinstance(seq, (list, tuple))
            and 0 < len(seq) <= MAX_BAD_WORD_TOKENS
            and all(_is_int(t) and 0 <= t <= INT32_MAX for t in seq),
            "bad_words_token_ids",
            seq,
            rule,
        )


def check_vocab_fields(sp: "SamplingParams", vocab_size: int | None) -> str | None:
    """-> None when every token id the sampler indexes by lies in the vocabulary, else the message.

    The engine checks this (the client may not know the vocabulary): the worker writes these ids into
    vocabulary-wide rows. bad_words that the client could not tokenize are refused here too.
    """
    if sp.bad_words and sp.bad_words_token_ids is None:
        return (
            f"SamplingParams.bad_words={short_repr(sp.bad_words)}: needs the model's tokenizer on the client "
            "to become token ids (bad_words_token_ids)"
        )
    if vocab_size is None:
        return None
    checks = (
        ("logit_bias", list(sp.logit_bias or ())),
        ("allowed_token_ids", list(sp.allowed_token_ids or ())),
        ("bad_words_token_ids", [t for seq in sp.bad_words_token_ids or () for t in seq]),
    )
    for name, ids in checks:
        err = check_token_ids(f"SamplingParams.{name}", ids, vocab_size)
        if err is not None:
            return err
    return None


def check_token_ids(field_name: str, ids: Any, vocab_size: int | None = None) -> str | None:
    """The one check of a token-id list; -> None when fine, else the message (naming the field and the rule).

    The ids go into int32 buffers, so without a vocabulary they must still fit int32.
    """
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        return f"{field_name}: must be a list of integers"
    hi = INT32_MAX + 1 if vocab_size is None else vocab_size
    bad = [t for t in ids if not 0 <= t < hi]
    if bad:
        shown = ", ".join(short_repr(t) for t in bad[:5])
        where = (
            f"outside the vocabulary [0, {vocab_size})"
            if vocab_size is not None
            else f"outside [0, {INT32_MAX}] (int32)"
        )
        return f"{field_name} has id(s) [{shown}] {where}"
    return None


def check_text(field_name: str, text: Any) -> str | None:
    """-> None for a str that is valid Unicode, else the message; a lone surrogate cannot be encoded."""
    if not isinstance(text, str):
        return f"{field_name}: must be a string, got {type(text).__name__}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"{field_name}: not valid Unicode (lone surrogate U+{ord(text[e.start]):04X} at index "
            f"{e.start}); strings must be valid UTF-8"
        )
    return None


def check_request_id(rid: Any) -> str | None:
    """-> None for a usable request id (a non-empty printable string, bounded), else the message."""
    if not isinstance(rid, str) or not rid:
        return f"request_id={short_repr(rid)}: must be a non-empty string"
    if len(rid) > MAX_ID_CHARS:
        return f"request_id={short_repr(rid)}: must be at most {MAX_ID_CHARS} characters"
    err = check_text("request_id", rid)
    if err is not None:
        return err
    if not rid.isprintable():
        return f"request_id={short_repr(rid)}: must be printable (no control characters or newlines)"
    return None


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction (vLLM's names and meanings).

    Ranges: see validate(). A temperature below GREEDY_TEMPERATURE is greedy, as in vLLM.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    min_tokens: int = 0  # EOS and stop_token_ids do not stop a request before this many output tokens
    # vLLM's penalties: presence/frequency subtract per output-token occurrence (OpenAI's definition),
    # repetition divides positive / multiplies negative logits of tokens seen in prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k log-probabilities per sampled token (0..20), plus its own
    prompt_logprobs: int | None = None  # the same for each prompt token
    # Handled on the client (cluster/client/output_processor.py), vLLM's names and meanings.
    n: int = 1  # samples of the prompt, each an engine request
    stop: str | list[str] | None = None  # stop strings, normalized to a list
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Logits processors, vLLM's names and meanings, applied in the sampler (actors/sample/kernel.py).
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's; 0 disables
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (JSON's string keys converted)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed: a word's last token is banned after its others
    # bad_words as token sequences: the client fills it with its tokenizer (each word with and without a
    # leading space, as vLLM's update_from_tokenizer); the engine reads only this.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    best_of: int | None = None  # refused above 1, as vLLM V1 does (use n)

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _int_keys(self.logit_bias)
        validate(self)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.min_p = float(self.min_p)
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.logit_bias is not None:
            self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))  # vLLM drops repeats
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(seq) for seq in self.bad_words_token_ids]

    def validate(self) -> None:
        validate(self)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_logit_row(self) -> bool:
        """Whether the worker keeps a vocabulary-wide additive row for it: logit_bias, allowed_token_ids
        or one-token bad words (longer ones depend on the output and are banned per step)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.has_bad_words

    @property
    def has_bad_words(self) -> bool:
        return bool(self.bad_words_token_ids)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; an unknown key is an error that names it."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise RequestValidationError(
                f"SamplingParams: unknown field(s) {short_repr(unknown)}; known fields are {', '.join(sorted(known))}"
            )
        return cls(**d)


def _int_keys(d: dict[Any, Any]) -> dict[Any, Any]:
    """logit_bias from JSON has string keys ("42"); vLLM converts them. A key that is no integer stays, and
    validate() names it."""
    out: dict[Any, Any] = {}
    for k, v in d.items():
        if isinstance(k, str) and len(k) < 20:
            try:
                k = int(k)
            except ValueError:
                pass
        out[k] = v
    return out


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request as the scheduler and the KV-cache manager see it.

    `all_token_ids` is prompt + output; `num_computed_tokens` counts tokens whose KV is in the cache
    (advanced by the scheduler); `block_hashes` holds the chained hashes of its full blocks, filled
    incrementally by the KV-cache manager.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 = not scheduled yet
        self.num_preemptions = 0
        # Output tokens scheduled but not yet received (async scheduling: the step that samples them is
        # still in flight). The scheduler plans with all_token_ids plus these many tokens.
        self.num_output_placeholders = 0
        self.block_hashes: list[Any] = []
        # The scheduler's kvcore.sched.stopping.StopRule while the request is in its book (None outside it):
        # the hot loops read it here instead of looking the request id up every step.
        self.stop_rule: Any = None
        self.stop_reason: int | None = None
        self.error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
