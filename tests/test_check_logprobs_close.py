"""benchmarks/checks/check_logprobs_close.py: vLLM's logprobs comparison rule on hand-made outputs, and the
script's CPU smoke end to end (kvray and HF in float32 on a tiny hybrid-attention Gemma-3)."""

import json
from pathlib import Path

import pytest

from benchmarks.checks.check_logprobs_close import best_first, check_sequence, in_top, kvray_topk, main
from cluster.outputs import Logprob

K = 5
# Three positions; HF's greedy token at each is its top-1.
HF_TOKENS = [10, 20, 30]
HF_TOP = [
    {10: -0.1, 11: -2.0, 12: -3.0, 13: -4.0, 14: -5.0},
    {20: -0.5, 21: -0.9, 22: -3.0, 23: -4.0, 24: -5.0},
    {30: -0.2, 31: -2.0, 32: -3.0, 33: -4.0, 34: -5.0},
]


def test_identical_sequences_pass_and_measure_the_shared_logprob():
    kv_top = [dict(d) for d in HF_TOP]
    kv_top[1][20] = -0.5 + 0.03
    got = check_sequence(0, list(HF_TOKENS), kv_top, HF_TOKENS, HF_TOP, K)
    assert got.ok and got.first_div is None and got.reason == ""
    assert abs(got.max_lp_diff - 0.03) < 1e-9


def test_divergence_inside_both_top_k_passes_and_stops_there():
    # kvray picks 21 at position 1 (HF's second); HF's 20 is kvray's second. Position 2 differs wildly
    # afterwards: the continuation is not compared.
    kv_top = [HF_TOP[0], {21: -0.6, 20: -0.8, 22: -3.0, 23: -4.0, 24: -5.0}, {99: -0.1}]
    got = check_sequence(3, [10, 21, 99], kv_top, HF_TOKENS, HF_TOP, K)
    assert got.ok and got.first_div == 1
    assert got.reason == "prompt 3, position 1: kvray 21 is HF's #2 (-0.9000), HF 20 is kvray's #2 (-0.8000)"


def test_kvray_token_outside_hf_top_k_fails():
    kv_top = [HF_TOP[0], {77: -0.4, 20: -0.7, 22: -3.0, 23: -4.0, 24: -5.0}, HF_TOP[2]]
    got = check_sequence(2, [10, 77, 30], kv_top, HF_TOKENS, HF_TOP, K)
    assert not got.ok and got.first_div == 1
    assert "kvray's token 77 is not in HF's top-5" in got.reason and "HF's token" not in got.reason
    assert "prompt 2, position 1" in got.reason and "matched tokens [10]" in got.reason


def test_only_the_first_k_of_a_wider_dict_count():
    # HF keeps 7 ranks; kvray's token is HF's 6th: outside the top-5, and the message says how far.
    hf_wide = [HF_TOP[0], {**HF_TOP[1], 25: -5.5, 26: -6.0}, HF_TOP[2]]
    kv_top = [HF_TOP[0], {25: -0.4, 20: -0.7, 22: -3.0, 23: -4.0, 24: -5.0}, HF_TOP[2]]
    got = check_sequence(0, [10, 25, 30], kv_top, HF_TOKENS, hf_wide, K)
    assert not got.ok and "kvray's token 25 is not in HF's top-5 (HF: #6 (-5.5000))" in got.reason
    assert check_sequence(0, [10, 25, 30], kv_top, HF_TOKENS, hf_wide, 6).ok


def test_hf_token_outside_kvray_top_k_fails():
    kv_top = [HF_TOP[0], {21: -0.4, 22: -0.7, 23: -3.0, 24: -4.0, 25: -5.0}, HF_TOP[2]]
    got = check_sequence(0, [10, 21, 30], kv_top, HF_TOKENS, HF_TOP, K)
    assert not got.ok and got.first_div == 1
    assert "HF's token 20 is not in kvray's top-5" in got.reason and "kvray's token" not in got.reason


def test_lengths_or_missing_logprobs_fail():
    assert not check_sequence(0, [10, 20], HF_TOP[:2], HF_TOKENS, HF_TOP, K).ok
    got = check_sequence(0, [10, 21, 30], HF_TOP[:1], HF_TOKENS, HF_TOP, K)
    assert not got.ok and "no logprobs" in got.reason


def test_kvray_topk_keeps_ranks_up_to_k():
    # vLLM's dict also holds the sampled token when it ranks below k.
    pos = {9: Logprob(-7.0, 12), 2: Logprob(-1.0, 2), 1: Logprob(-0.1, 1)}
    assert list(kvray_topk(pos, 2).items()) == [(1, -0.1), (2, -1.0)]  # best first
    assert kvray_topk(pos, 1) == {1: -0.1}


def test_smoke_end_to_end(tmp_path, capsys):
    res = tmp_path / "results"
    rc = main(["--smoke", "--shapes", "gemma-3-12b", "--model-dir", str(tmp_path), "--results-dir", str(res)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "gemma-3-12b: PASS" in out and out.rstrip().splitlines()[-1].startswith("PASS"), out[-3000:]
    assert "window 16" in out  # the tiny hybrid slides, and its prompts straddle the window
    recs = {r["metric"]: r for r in map(json.loads, (res / "check_logprobs_close.jsonl").read_text().splitlines())}
    assert recs["logprobs_close_pass_gemma_3_12b"]["value"] == 1.0
    assert recs["logprobs_close_pass"]["value"] == 1.0
    assert recs["logprobs_close_divergent_gemma_3_12b"]["unit"] == "sequences"
    assert 0 <= recs["logprobs_close_divergent_gemma_3_12b"]["value"] <= 4
    # float32 on both sides: the shared token's logprob agrees to float32 noise.
    assert recs["logprobs_close_max_lp_diff_gemma_3_12b"]["value"] < 1e-3
    assert all(r["device"] == "cpu" for r in recs.values())


def test_mistral_shape_is_served_with_its_window(tmp_path):
    from actors.models.args import mistral_layer_windows
    from actors.models.registry import resolve_architecture
    from benchmarks.common import SHAPES, make_random_model

    assert SHAPES["mistral-7b"]["sliding_window"] == 4096  # Mistral-7B-v0.1's config
    cfg = json.loads(
        (Path(make_random_model("mistral-7b", str(tmp_path), "float32", tiny=True)) / "config.json").read_text()
    )
    assert resolve_architecture(cfg).__name__ == "MistralForCausalLM"
    assert mistral_layer_windows(cfg) == [16] * 4  # the tiny window every layer slides by


def test_a_tie_with_the_kth_counts_as_inside():
    # HF's 5th and 6th share a logprob (bf16 logits tie): either may be the one topk kept.
    hf_wide = [HF_TOP[0], {**HF_TOP[1], 25: -5.0}, HF_TOP[2]]
    kv_top = [HF_TOP[0], {25: -0.4, 20: -0.7, 22: -3.0, 23: -4.0, 24: -5.0}, HF_TOP[2]]
    assert check_sequence(0, [10, 25, 30], kv_top, HF_TOKENS, hf_wide, K).ok
    assert in_top({1: -1.0, 2: -2.0, 3: -2.0}, 3, 2) and not in_top({1: -1.0, 2: -2.0, 3: -2.5}, 3, 2)


def test_best_first_puts_the_greedy_token_of_a_tie_first():
    # argmax takes the lowest id of a tie; topk may list another first.
    assert list(best_first([(137294, -9.44), (71600, -9.44), (5, -9.5)])) == [71600, 137294, 5]


@pytest.mark.parametrize(
    "flags,suffix",
    [(["--kv-cache-dtype", "fp8"], "_fp8kv"), (["--quantization", "fp8", "--kv-cache-dtype", "fp8"], "_fp8w_fp8kv")],
)
def test_fp8_end_to_end_follows_the_rule(tmp_path, capsys, flags, suffix):
    """kvray with its KV cache in fp8, and with its linear weights in fp8 too (float32 model, a hybrid
    Gemma-3 whose sliding and full groups both store fp8), against HF float32: no longer token-equal by
    construction, but every divergence inside both sides' top-5, and the shared tokens' logprobs within
    fp8's rounding. Against the control (HF's own modules under the same e4m3 rounding) kvray is
    token-equal, with logprobs at float32's noise: its fp8 is that rounding and nothing else."""
    res = tmp_path / "results"
    argv = ["--smoke", "--shapes", "gemma-3-12b", "--model-dir", str(tmp_path), "--results-dir", str(res)]
    rc = main([*argv, *flags])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "kvray's KV cache fp8" in out and out.rstrip().splitlines()[-1].startswith("PASS"), out[-3000:]
    recs = {r["metric"]: r for r in map(json.loads, (res / "check_logprobs_close.jsonl").read_text().splitlines())}
    assert recs[f"logprobs_close_pass_gemma_3_12b{suffix}"]["value"] == 1.0
    assert recs[f"logprobs_close_pass{suffix}"]["value"] == 1.0
    # Not float32 noise any more (the numbers really pass through fp8), and not garbage either.
    assert 1e-4 < recs[f"logprobs_close_max_lp_diff_gemma_3_12b{suffix}"]["value"] < 0.5
    ctl = f"logprobs_close_control_max_lp_diff_gemma_3_12b{suffix}"
    assert recs[ctl]["value"] > 1e-4, "the control's rounding changed nothing"
    assert recs[f"logprobs_close_vs_control_divergent_gemma_3_12b{suffix}"]["value"] == 0
    assert recs[f"logprobs_close_vs_control_max_lp_diff_gemma_3_12b{suffix}"]["value"] < 1e-4
    assert "kvray against HF fp8: gemma-3-12b: PASS; identical 4/4" in out, out[-3000:]
