"""SamplingParams / token-id / text / request-id rules in kvcore.request, without Ray: each broken rule
raises (or returns) a message that names the field and the rule."""

import math

import pytest

from kvcore.request import (
    GREEDY_TEMPERATURE,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    RequestValidationError,
    SamplingParams,
    check_request_id,
    check_text,
    check_token_ids,
    short_repr,
    validate,
)


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": INT32_MAX},
        {"top_k": -1},
        {"seed": INT64_MAX},
        {"seed": INT64_MIN},
        {"seed": 0},
        {"max_tokens": MAX_TOKENS_LIMIT},
        {"temperature": MAX_TEMPERATURE},
        {"temperature": 1},
        {"stop_token_ids": [0, INT32_MAX]},
        {"stop_token_ids": (3, 4)},
        {"top_p": 1},
    ],
)
def test_values_at_the_edges_are_accepted(fields):
    sp = SamplingParams(**fields)
    validate(sp)
    assert isinstance(sp.temperature, float) and isinstance(sp.top_p, float)
    assert isinstance(sp.stop_token_ids, list)


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("top_k", INT32_MAX + 1, "top_k=2147483648: must be >= -1 (0 or -1 disables top-k) and <= 2147483647"),
        ("top_k", 1.0, "top_k=1.0: must be an integer"),
        ("top_k", True, "top_k=True: must be an integer"),
        ("seed", INT64_MAX + 1, "seed=9223372036854775808: must be None or an integer in"),
        ("seed", INT64_MIN - 1, "seed=-9223372036854775809: must be None or an integer in"),
        ("seed", 1.5, "seed=1.5: must be None or an integer"),
        ("max_tokens", MAX_TOKENS_LIMIT + 1, f"max_tokens={MAX_TOKENS_LIMIT + 1}: must be >= 1 and <= 16777216"),
        ("max_tokens", 0, "max_tokens=0: must be >= 1"),
        ("temperature", math.inf, "temperature=inf: must be finite and >= 0 and <= 100"),
        ("temperature", -math.inf, "temperature=-inf: must be finite"),
        ("temperature", math.nan, "temperature=nan: must be finite"),
        ("temperature", MAX_TEMPERATURE * 1.01, "temperature=101.0: must be finite and >= 0 and <= 100"),
        ("temperature", 10**400, "temperature=<1329-bit int>: must be finite"),
        ("temperature", "0.5", "temperature='0.5': must be a number"),
        ("top_p", math.nan, "top_p=nan: must be in (0, 1]"),
        ("top_p", 10**400, "top_p=<1329-bit int>: must be in (0, 1]"),
        ("stop_token_ids", [INT32_MAX + 1], "stop_token_ids=[2147483648]: must be a list of at most 1024"),
        ("stop_token_ids", [1] * 1025, "stop_token_ids=[1, 1, 1, 1, 1, 1, 1, 1, ...]: must be a list of at most 1024"),
        ("stop_token_ids", "12", "stop_token_ids='12': must be a list"),
        ("ignore_eos", 1, "ignore_eos=1: must be a bool"),
    ],
)
def test_out_of_range_values_name_the_field_and_the_rule(field, value, rule):
    with pytest.raises(RequestValidationError) as e:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{rule}" in str(e.value)
    assert len(str(e.value)) < 400  # never the whole value


def test_validate_catches_changes_after_construction():
    for field, value in [
        ("max_tokens", 0),
        ("temperature", math.nan),
        ("top_k", 2**40),
        ("seed", 2**64),
        ("top_p", 0.0),
        ("stop_token_ids", None),
    ]:
        sp = SamplingParams()
        setattr(sp, field, value)
        with pytest.raises(RequestValidationError, match=f"SamplingParams.{field}="):
            validate(sp)
        with pytest.raises(RequestValidationError, match=f"SamplingParams.{field}="):
            sp.validate()


def test_a_temperature_below_the_greedy_threshold_is_greedy():
    assert SamplingParams(temperature=1e-50).greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_from_dict_names_unknown_fields():
    with pytest.raises(RequestValidationError, match=r"unknown field\(s\) \['max_token'\]"):
        SamplingParams.from_dict({"max_token": 3})


def test_token_id_lists():
    assert check_token_ids("p", [0, 1, INT32_MAX]) is None
    assert check_token_ids("p", [0, 259], vocab_size=260) is None
    assert check_token_ids("p", [1, 2**31]) == "p has id(s) [2147483648] outside [0, 2147483647] (int32)"
    assert check_token_ids("p", [-1, 260, 5], vocab_size=260) == "p has id(s) [-1, 260] outside the vocabulary [0, 260)"
    assert check_token_ids("p", [1, True]) == "p: must be a list of integers"
    assert check_token_ids("p", (1, 2)) == "p: must be a list of integers"
    msg = check_token_ids("p", [10**5000])
    assert msg is not None and "<16610-bit int>" in msg and len(msg) < 200


def test_text_must_be_valid_unicode():
    assert check_text("prompt", "héllo ✓") is None
    assert check_text("prompt", "a\udc80b") == (
        "prompt: not valid Unicode (lone surrogate U+DC80 at index 1); strings must be valid UTF-8"
    )
    assert check_text("prompt", b"x") == "prompt: must be a string, got bytes"


@pytest.mark.parametrize(
    "rid,rule",
    [
        ("\ud800", "request_id: not valid Unicode (lone surrogate U+D800 at index 0)"),
        ("a\tb", "request_id='a\\tb': must be printable"),
        ("x" * 513, "must be at most 512 characters"),
        ("", "must be a non-empty string"),
        (7, "request_id=7: must be a non-empty string"),
    ],
)
def test_request_ids(rid, rule):
    msg = check_request_id(rid)
    assert msg is not None and rule in msg and len(msg) < 300


def test_good_request_ids():
    for rid in ["0", "req-1", "ü 中文 id", "x" * 512]:
        assert check_request_id(rid) is None


def test_error_for_a_nested_value_stays_short():
    # Found by tests/test_fuzz_inputs.py: reprlib bounds each level, so nesting multiplied the message.
    value = {f"k{i}": {f"j{j}": ["\U000ef0b0" * 80, {"x": "\ud800" * 80}] for j in range(8)} for i in range(8)}
    msg = check_request_id(value)
    assert msg is not None and msg.startswith("request_id=") and len(msg) < 300
    assert len(short_repr(value)) <= 200
