"""Hypothesis strategies for hostile inputs: request fields, prompts and whole input lines.

Shared by tests/test_fuzz_inputs.py (a few hundred examples in CI) and benchmarks/checks/check_fuzz_long.py (a run of
10,000+ lines through `kvray run`). Every input line is one line: it never holds b"\\n" or b"\\r", and
never is blank, so "every line is answered exactly once" can be checked by line number.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from kvcore.request import SamplingParams

VOCAB = 260  # tiny-random
FIELDS = sorted(SamplingParams.__dataclass_fields__)  # new fields are fuzzed as soon as they exist

EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, 10**400]
EDGE_FLOATS = [
    0.0,
    -0.0,
    1e-50,
    1e-5,
    5e-324,
    1e300,
    -1e300,
    float("inf"),
    float("-inf"),
    float("nan"),
    100.0,
    100.0000001,
    0.5,
    1.0,
    2.0,
]
BAD_TEXT = ["\ud800", "a\udc80b", "\udfff\ud800", "\x00", "\u2028", "\ufeff", "\U0010ffff", "é" * 3, "\x1b[2J"]

ints = st.integers() | st.sampled_from(EDGE_INTS)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(EDGE_FLOATS)
texts = (
    st.text(max_size=40)
    | st.sampled_from(BAD_TEXT)
    | st.tuples(st.text(max_size=10), st.sampled_from(BAD_TEXT), st.text(max_size=10)).map("".join)
)
scalars = st.none() | st.booleans() | ints | floats | texts
json_values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(texts, kids, max_size=4), max_leaves=12
)


def _field_value(name: str) -> st.SearchStrategy:
    near = {
        "temperature": floats,
        "top_p": floats,
        "top_k": ints,
        "max_tokens": st.integers(-2, 80) | ints,
        "seed": ints,
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(ints, max_size=4),
    }
    return near.get(name, scalars) | json_values


# A dict of sampling fields: mostly known names with values near their edges, sometimes any JSON,
# sometimes a key that does not exist.
sampling_fields = st.lists(st.sampled_from(FIELDS), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({n: _field_value(n) for n in names})
) | st.dictionaries(texts, json_values, max_size=3)

token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
hostile_token_ids = st.lists(ints, max_size=8) | st.lists(json_values, max_size=4) | json_values

# A prompt for LLM.generate: text (possibly bad Unicode), a token-id dict, or anything at all.
prompts = (
    texts
    | st.fixed_dictionaries({"prompt_token_ids": token_ids | hostile_token_ids})
    | st.fixed_dictionaries({"prompt": texts})
    | json_values
)


def _dump(obj: object, ensure_ascii: bool) -> bytes:
    text = json.dumps(obj, ensure_ascii=ensure_ascii, allow_nan=True)
    # ensure_ascii=False leaves a lone surrogate raw: encoded with surrogatepass it is invalid UTF-8
    return text.encode("utf-8", "surrogatepass")


@st.composite
def _record_line(draw: st.DrawFn) -> bytes:
    rec: dict = {}
    if draw(st.booleans()):
        rec["id"] = draw(texts | ints | json_values)
    kind = draw(st.sampled_from(["prompt", "prompt_token_ids", "both", "neither"]))
    if kind in ("prompt", "both"):
        rec["prompt"] = draw(texts | json_values)
    if kind in ("prompt_token_ids", "both"):
        rec["prompt_token_ids"] = draw(token_ids | hostile_token_ids)
    rec.update(draw(sampling_fields))
    return _dump(rec, ensure_ascii=draw(st.booleans()))


def _no_newlines(raw: bytes) -> bytes:
    return b"x" + raw.replace(b"\n", b" ").replace(b"\r", b" ")


good_lines = st.builds(
    lambda ids, n: json.dumps({"prompt_token_ids": ids, "max_tokens": n, "ignore_eos": True}).encode(),
    token_ids,
    st.integers(1, 3),
)
hostile_lines = (
    _record_line()
    | json_values.flatmap(lambda v: st.booleans().map(lambda a: _dump(v, a)))  # not an object
    | st.sampled_from([10, 1000, 100_000]).map(lambda n: b"[" * n + b"]" * n)  # deep nesting
    | st.sampled_from([10, 1000, 100_000]).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)
    | st.sampled_from([400, 5000, 20_000]).map(lambda n: b'{"prompt_token_ids": [' + b"9" * n + b"]}")
    | st.sampled_from([400, 5000]).map(lambda n: b'{"prompt_token_ids": [1], "seed": ' + b"9" * n + b"}")
    | st.binary(max_size=60).map(_no_newlines)  # raw bytes
    | _record_line().flatmap(lambda line: st.integers(1, max(1, len(line) - 1)).map(lambda k: line[:k]))
)
input_lines = good_lines | hostile_lines
