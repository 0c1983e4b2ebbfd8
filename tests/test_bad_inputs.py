"""A table of bad inputs: each gets a clear error that names the thing and the rule, and a bad request
fails alone while the engine serves the others in the same run.

One local Ray and one engine serve every request-level case: the bad prompts go through one
`LLM.generate` call and the bad input lines through one batch job, each next to good ones; each case
then checks its own output. Config, model and CLI cases fail before (or while) an engine starts."""

import json
import os
import shutil
import time

import pytest
import ray
from waits import within

from actors.messages import RequestSpec
from actors.models.loader import resolve_model_dir
from cluster import LLM, SamplingParams
from cluster.cli import main as kvray_main
from cluster.config import ConfigError, EngineConfig, load_config
from cluster.job.runner import Job, read_items
from cluster.replicas.placement import PlacementError, start_local_ray
from kvcore.request import RequestValidationError

MAX_MODEL_LEN = 64
GOOD = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    start_local_ray(num_cpus=4, namespace="kvray-test-bad-inputs", include_dashboard=False)
    engine = LLM(
        model="tiny-random",
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        step_timeout_s=60,
    )
    try:
        yield engine
    finally:
        engine.shutdown()
        ray.shutdown()


# ---- requests through the API: one generate call, bad prompts among good ones -----------------------
API_CASES = {
    "empty_prompt": ({"prompt_token_ids": []}, "prompt_token_ids is empty; a request needs at least one"),
    "empty_text_prompt": ("", "prompt_token_ids is empty"),
    "token_ids_outside_vocab": (
        {"prompt_token_ids": [5, 260, 99999]},
        "prompt_token_ids has id(s) [260, 99999] outside the vocabulary [0, 260)",
    ),
    "negative_token_id": ({"prompt_token_ids": [-1, 3]}, "has id(s) [-1] outside [0, "),
    "prompt_longer_than_max_model_len": (
        {"prompt_token_ids": [7] * (MAX_MODEL_LEN + 10)},
        f"exceeds max_model_len={MAX_MODEL_LEN}",
    ),
    "prompt_token_ids_not_ints": ({"prompt_token_ids": [1, "2", 3.0]}, "prompt_token_ids: must be a list of integers"),
    "prompt_token_ids_not_a_list": ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids: must be a list of integers"),
    "prompt_dict_with_both_keys": ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of 'prompt' or"),
    "text_prompt_lone_surrogate": ("a\udc80b", "not valid Unicode (lone surrogate U+DC80 at index 1)"),
    "token_id_past_int32": ({"prompt_token_ids": [1, 2**40]}, "has id(s) [1099511627776] outside [0, 2147483647]"),
}


@pytest.fixture(scope="module")
def api_run(llm):
    names = list(API_CASES)
    prompts = []
    for name in names:  # a good prompt after every bad one
        prompts += [API_CASES[name][0], {"prompt_token_ids": [11, 12, 13]}]
    outs = llm.generate(prompts, GOOD)
    return {name: (outs[2 * i], outs[2 * i + 1]) for i, name in enumerate(names)}


@pytest.mark.parametrize("case", list(API_CASES))
def test_bad_request_fails_alone(api_run, case):
    bad, good = api_run[case]
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert API_CASES[case][1] in bad.error, bad.error
    assert good.error is None and len(good.outputs[0].token_ids) == 4, good  # the engine went on


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("max_tokens", 0, "SamplingParams.max_tokens=0: must be >= 1"),
        ("temperature", -0.5, "SamplingParams.temperature=-0.5: must be finite and >= 0"),
        ("top_p", 0, "SamplingParams.top_p=0: must be in (0, 1]"),
        ("top_k", -5, "SamplingParams.top_k=-5: must be >= -1 (0 or -1 disables top-k)"),
        (
            "stop_token_ids",
            [-3],
            "SamplingParams.stop_token_ids=[-3]: must be a list of at most 1024 integers in [0, 2147483647]",
        ),
        (
            "seed",
            "x",
            "SamplingParams.seed='x': must be None or an integer in [-9223372036854775808, "
            "9223372036854775807] (int64)",
        ),
        ("top_k", 2**31, "SamplingParams.top_k=2147483648: must be >= -1 (0 or -1 disables top-k) and <= 2147483647"),
        ("seed", 2**64, "SamplingParams.seed=18446744073709551616: must be None or an integer in"),
        ("max_tokens", 2**24 + 1, "SamplingParams.max_tokens=16777217: must be >= 1 and <= 16777216"),
        ("temperature", 1e300, "SamplingParams.temperature=1e+300: must be finite and >= 0 and <= 100"),
        ("temperature", float("nan"), "SamplingParams.temperature=nan: must be finite"),
        ("temperature", 10**400, "SamplingParams.temperature=<1329-bit int>: must be finite"),
    ],
)
def test_bad_sampling_params_are_refused_when_built(field, value, rule):
    with pytest.raises(RequestValidationError) as e:
        SamplingParams(**{field: value})
    assert rule in str(e.value)


def test_duplicate_request_id_via_the_api_is_refused_and_the_first_one_runs(llm):
    engines = llm.engines
    errors = engines.submit(
        [RequestSpec("dup", [1, 2, 3], GOOD), RequestSpec("dup", [4, 5], GOOD), RequestSpec("other", [6, 7], GOOD)]
    )
    assert errors.keys() == {"dup"}
    assert "request 'dup': request_id is already in use by an unfinished request" in errors["dup"]
    finished, tokens = {}, {"dup": [], "other": []}
    t0 = time.monotonic()
    while len(finished) < 2 and time.monotonic() - t0 < 60:
        for o in engines.poll(timeout_s=0.5):
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in finished, "a request ended twice"
                finished[o.request_id] = o
    assert {k: v.finish_reason for k, v in finished.items()} == {"dup": "length", "other": "length"}
    assert len(tokens["dup"]) == 4 and len(tokens["other"]) == 4


# ---- input lines through the batch job: one run, bad lines among good ones ---------------------------
LINE_CASES = {
    "non_json_line": ('{"prompt": "unterminated', "line {n}: not valid JSON"),
    "json_not_an_object": ("[1, 2, 3]", "line {n}: must be a JSON object, got list"),
    "unknown_field": ('{"id": "u", "prompt": "hi", "max_token": 3}', "line {n}: unknown field(s) ['max_token']"),
    "no_prompt": ('{"id": "np", "max_tokens": 3}', "line {n}: needs exactly one of 'prompt' or 'prompt_token_ids'"),
    "prompt_not_a_string": ('{"id": "ps", "prompt": 5}', "line {n}: prompt must be a string"),
    "prompt_token_ids_not_ints": (
        '{"id": "pt", "prompt_token_ids": [1, "a"]}',
        "line {n}: prompt_token_ids: must be a list of integers",
    ),
    "max_tokens_0": ('{"id": "m0", "prompt": "hi", "max_tokens": 0}', "SamplingParams.max_tokens=0: must be >= 1"),
    "max_tokens_float": ('{"id": "mf", "prompt": "hi", "max_tokens": 2.5}', "max_tokens=2.5: must be an integer"),
    "negative_temperature": (
        '{"id": "nt", "prompt": "hi", "temperature": -1}',
        "temperature=-1: must be finite and >= 0",
    ),
    "top_p_0": ('{"id": "tp", "prompt": "hi", "top_p": 0}', "SamplingParams.top_p=0: must be in (0, 1]"),
    "top_k_negative": ('{"id": "tk", "prompt": "hi", "top_k": -5}', "SamplingParams.top_k=-5: must be >= -1"),
    "top_k_past_int32": (
        '{"id": "k32", "prompt_token_ids": [1, 2], "temperature": 1, "top_k": 2147483648}',
        "SamplingParams.top_k=2147483648: must be >= -1 (0 or -1 disables top-k) and <= 2147483647",
    ),
    "seed_past_int64": (
        '{"id": "s64", "prompt_token_ids": [1, 2], "seed": 18446744073709551616}',
        "SamplingParams.seed=18446744073709551616: must be None or an integer in",
    ),
    "bad_id": ('{"id": [1], "prompt": "hi"}', "line {n}: id=[1] must be a non-empty string or an integer"),
    "duplicate_id": ('{"id": "good-0", "prompt": "again"}', "line {n}: duplicate id 'good-0'"),
    "empty_prompt_line": ('{"id": "ep", "prompt_token_ids": []}', "prompt_token_ids is empty"),
    "out_of_vocab_line": ('{"id": "ov", "prompt_token_ids": [1, 300]}', "outside the vocabulary [0, 260)"),
    "too_long_line": (
        '{"id": "tl", "prompt_token_ids": ' + json.dumps([3] * 100) + "}",
        f"exceeds max_model_len={MAX_MODEL_LEN}",
    ),
}


@pytest.fixture(scope="module")
def job_run(llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("badlines")
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    lines, line_of = [], {}
    for i, (name, (text, _)) in enumerate(LINE_CASES.items()):
        lines.append(
            json.dumps({"id": f"good-{i}", "prompt_token_ids": [20 + i, 21], "max_tokens": 3, "ignore_eos": True})
        )
        lines.append(text)
        line_of[name] = len(lines)
    inp.write_text("\n".join(lines) + "\n")
    job = Job(llm.config, llm.engines, llm.tokenizer, str(out), progress=False)
    stats = job.run(read_items(str(inp), SamplingParams(max_tokens=3, ignore_eos=True)))
    recs = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    return stats, recs, line_of


@pytest.mark.parametrize("case", list(LINE_CASES))
def test_bad_input_line_fails_alone(job_run, case):
    stats, recs, line_of = job_run
    n = line_of[case]
    rec = recs[n]
    assert rec["finish_reason"] == "error" and rec["output_token_ids"] == []
    assert LINE_CASES[case][1].format(n=n) in rec["error"], rec["error"]
    good = recs[n - 1]  # the good line just before it was answered in the same run
    assert good["error"] is None and len(good["output_token_ids"]) == 3, good
    assert stats.completed == len(LINE_CASES) and stats.errors == len(LINE_CASES)


# ---- the command line --------------------------------------------------------------------------------
def test_missing_input_file(tmp_path, capsys):
    assert kvray_main(["run", "--input", str(tmp_path / "nope.jsonl")]) == 2
    assert f"--input '{tmp_path / 'nope.jsonl'}': no such file" in capsys.readouterr().err


def test_unwritable_output_path(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "out.jsonl"  # a path under a regular file: never writable, even for root
    assert kvray_main(["run", "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--output '{out}': cannot be written ('{blocker}' is a file, not a directory)" in err, err
    assert kvray_main(["run", "--input", str(inp), "--output", str(tmp_path)]) == 2  # a directory
    assert f"--output '{tmp_path}': a directory, not a regular file" in capsys.readouterr().err


def test_malformed_set_override(capsys):
    assert kvray_main(["info", "--set", "cache.block_size"]) == 2
    assert "--set 'cache.block_size': must look like section.field=value" in capsys.readouterr().err


# ---- configs -----------------------------------------------------------------------------------------
def test_config_with_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  blok_size: 16\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "unknown key(s) ['cache.blok_size']; known keys in [cache] are" in str(e.value)
    path.write_text("caches:\n  block_size: 16\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "unknown section(s) ['caches']" in str(e.value)


def test_config_with_wrong_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  max_num_seqs: many\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "scheduler.max_num_seqs='many': must be an integer" in str(e.value) and str(path) in str(e.value)
    with pytest.raises(ConfigError) as e:
        EngineConfig().replace(enable_prefix_caching="yes")
    assert "cache.enable_prefix_caching='yes': must be a bool (true/false)" in str(e.value)


def test_block_size_not_a_power_of_two():
    with pytest.raises(ConfigError) as e:
        EngineConfig().replace(block_size=24)
    assert "cache.block_size=24: must be a power of two in [1, 1024]" in str(e.value)


def test_tp_not_dividing_the_heads_fails_before_any_actor_starts():
    with pytest.raises(ConfigError) as e:
        LLM(model="tiny-random", tensor_parallel_size=3)
    assert "parallel.tensor_parallel_size=3: must divide the model's num_attention_heads=4" in str(e.value)


# ---- model directories -------------------------------------------------------------------------------
@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(resolve_model_dir("tiny-random"), dst)
    return dst


def test_model_dir_without_config_json(model_copy):
    os.remove(model_copy / "config.json")
    with pytest.raises(FileNotFoundError) as e:
        LLM(model=str(model_copy))
    assert f"{model_copy}: no config.json (not an HF model directory)" in str(e.value)


def test_unsupported_architecture_fails_before_any_actor_starts(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(model=str(model_copy))
    assert "architecture 'GPT2LMHeadModel' is not supported; supported: [" in str(e.value)


def test_truncated_safetensors_names_the_file_and_the_rank(llm, model_copy):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError) as e:
        LLM(model=str(model_copy), num_gpu_blocks=16)
    msg = str(e.value)
    assert "worker rank 0" in msg and "load_model" in msg, msg
    assert f"{weights}: truncated or corrupt safetensors file" in msg, msg
    # The engine that was already running is untouched.
    assert len(llm.generate([{"prompt_token_ids": [1, 2]}], GOOD)[0].outputs[0].token_ids) == 4


def test_cluster_without_enough_gpus_fails_at_once(llm):
    # Were it waited for, the placement timeout would outlast the bound.
    with pytest.raises(PlacementError) as e:
        within(120, LLM, model="tiny-random", device="cuda", tensor_parallel_size=2, placement_timeout_s=3600)
    msg = str(e.value)
    assert "asked for 2 bundle(s) {'GPU': 1.0}" in msg and "the cluster does not have that many" in msg, msg


# ---- the driver re-validates what it receives ----------------------------------------------------------
def _mutated(**fields):
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for k, v in fields.items():  # changed after construction: __post_init__ never sees it
        setattr(sp, k, v)
    return sp


@pytest.mark.parametrize(
    "fields,rule",
    [
        ({"max_tokens": 0}, "SamplingParams.max_tokens=0: must be >= 1"),
        ({"temperature": float("nan")}, "SamplingParams.temperature=nan: must be finite"),
        ({"top_k": 2**40}, "SamplingParams.top_k=1099511627776: must be >= -1"),
        ({"seed": 2**64}, "SamplingParams.seed=18446744073709551616: must be None or an integer"),
        ({"stop_token_ids": [2**31]}, "SamplingParams.stop_token_ids=[2147483648]: must be a list"),
    ],
)
def test_params_changed_after_construction_are_refused_by_the_driver(llm, fields, rule):
    bad, good = llm.generate([{"prompt_token_ids": [1, 2]}] * 2, [_mutated(**fields), GOOD])
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert rule in bad.error, bad.error
    assert good.error is None and len(good.outputs[0].token_ids) == 4


def test_tiny_temperature_is_greedy(llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy, tiny, mutated = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=1e-50, max_tokens=6, ignore_eos=True, seed=3),
            _mutated(temperature=1e-50, max_tokens=6),
        ],
    )
    assert tiny.outputs[0].token_ids == greedy.outputs[0].token_ids == mutated.outputs[0].token_ids
    assert len(set(greedy.outputs[0].token_ids)) > 1  # not a degenerate token-0 stream


@pytest.mark.parametrize(
    "rid,rule",
    [
        ("\ud800", "request_id: not valid Unicode (lone surrogate U+D800 at index 0)"),
        ("a\nb", "request_id='a\\nb': must be printable"),
        ("x" * 600, "must be at most 512 characters"),
        ("", "request_id='': must be a non-empty string"),
    ],
)
def test_bad_request_ids_are_refused_by_the_driver(llm, rid, rule):
    errors = llm.engines.submit([RequestSpec(rid, [1, 2], GOOD)])
    assert rule in errors[rid], errors
