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


@pytest.mark.parametrize(
    "fields,rule",
    [
        ({"best_of": 2}, "SamplingParams.best_of=2: is not supported (vLLM V1 does not support best_of either)"),
        ({"best_of": 0}, "SamplingParams.best_of=0: is not supported"),
        ({"min_p": 1.5}, "SamplingParams.min_p=1.5: must be in [0, 1]"),
        ({"min_p": math.nan}, "SamplingParams.min_p=nan: must be in [0, 1]"),
        ({"min_p": "0.1"}, "SamplingParams.min_p='0.1': must be a number"),
        ({"logit_bias": {"x": 1.0}}, "SamplingParams.logit_bias={'x': 1.0}: must be None or a dict"),
        ({"logit_bias": {5: 101}}, "SamplingParams.logit_bias={5: 101}: must be None or a dict"),
        ({"logit_bias": {5: math.inf}}, "bias (a number in [-100, 100])"),
        ({"logit_bias": {-1: 1.0}}, "token id (an integer in [0, 2147483647])"),
        ({"logit_bias": [1, 2]}, "SamplingParams.logit_bias=[1, 2]: must be None or a dict"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "at most 1024 entries"),
        ({"allowed_token_ids": []}, "SamplingParams.allowed_token_ids=[]: must be None or a non-empty list"),
        ({"allowed_token_ids": [1, -2]}, "SamplingParams.allowed_token_ids=[1, -2]: must be None or a non-empty"),
        ({"bad_words": [""]}, "SamplingParams.bad_words=['']: must be None or a list of at most 128 non-empty"),
        ({"bad_words": "word"}, "SamplingParams.bad_words='word': must be None or a list"),
        (
            {"bad_words_token_ids": [[]]},
            "SamplingParams.bad_words_token_ids=[]: must be None or a list of at most 256 non-empty lists",
        ),
    ],
)
def test_logits_processor_fields_name_the_field_and_the_rule(fields, rule):
    with pytest.raises(RequestValidationError) as e:
        SamplingParams(**fields)
    assert rule in str(e.value)


def test_logits_processor_fields_take_vllms_values():
    sp = SamplingParams(
        min_p=1, logit_bias={"7": -100, 9: 2}, allowed_token_ids=(1, 2), bad_words=["a", "b", "a"], best_of=1
    )
    assert sp.min_p == 1.0 and sp.logit_bias == {7: -100.0, 9: 2.0} and sp.allowed_token_ids == [1, 2]
    assert sp.bad_words == ["a", "b"]  # repeats dropped, as vLLM
    assert sp.has_logit_row and not sp.has_bad_words
    assert not SamplingParams(min_p=0.5).has_logit_row
    # from_dict names best_of like any other field (a job record or a request body)
    with pytest.raises(RequestValidationError, match="best_of=3"):
        SamplingParams.from_dict({"best_of": 3})


def test_vocabulary_checks_of_the_processor_fields():
    from kvcore.request import check_vocab_fields

    assert check_vocab_fields(SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9]), 10) is None
    err = check_vocab_fields(SamplingParams(logit_bias={10: 1.0}), 10)
    assert err is not None and "SamplingParams.logit_bias" in err and "[0, 10)" in err
    err = check_vocab_fields(SamplingParams(allowed_token_ids=[3, 12]), 10)
    assert err is not None and "allowed_token_ids has id(s) [12]" in err
    err = check_vocab_fields(SamplingParams(bad_words_token_ids=[[1, 11]]), 10)
    assert err is not None and "bad_words_token_ids" in err
    # bad_words the client could not tokenize (no tokenizer there) are refused, not ignored
    err = check_vocab_fields(SamplingParams(bad_words=["x"]), 10)
    assert err is not None and "SamplingParams.bad_words=['x']: needs the model's tokenizer" in err


def test_the_server_passes_the_processor_fields_through():
    from cluster.serve.errors import APIError
    from cluster.serve.protocol import CHAT, COMPLETIONS, parse_request

    body = {
        "prompt": "Hi",
        "min_p": 0.1,
        "logit_bias": {"5": -100, "7": 2},
        "allowed_token_ids": [5, 7, 9],
        "bad_words": ["no"],
    }
    sp = parse_request(COMPLETIONS, body, SamplingParams()).params
    assert (sp.min_p, sp.logit_bias, sp.allowed_token_ids, sp.bad_words) == (
        0.1,
        {5: -100.0, 7: 2.0},
        [5, 7, 9],
        ["no"],
    )
    chat = parse_request(
        CHAT, {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 1}}, SamplingParams()
    )
    assert chat.params.logit_bias == {3: 1.0}
    with pytest.raises(APIError, match=r"SamplingParams.logit_bias=\{5: 101\}"):
        parse_request(COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": 101}}, SamplingParams())
