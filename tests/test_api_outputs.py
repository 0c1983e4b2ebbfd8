"""Sampling and output features end to end on the built-in tiny-random model (LLM -> driver actor ->
worker, on the CPU): greedy text equals HF, stop strings cut the text and abort the request in the
engine, n samples with derived seeds share the prompt's KV, chat equals HF's rendering, and the
defaults come from the model. One local Ray and one LLM for the module."""

import os
import time

import hf_models as H
import pytest
import ray
import torch
import transformers

from cluster import LLM, SamplingParams
from cluster.client.logprobs import engine_computes_logprobs
from cluster.replicas.placement import start_local_ray

COMMON = dict(
    device="cpu",
    dtype="float32",
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=128,
    cpu_kv_cache_gib=0.01,
    step_timeout_s=60,
    placement_timeout_s=30,
)
PROMPT = "The quick brown fox jumps over the lazy dog"  # 43 byte tokens: 5 full blocks to share
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("kvray-cache"))
    old = os.environ.get("KVRAY_CACHE")
    os.environ["KVRAY_CACHE"] = cache  # the workers resolve tiny-random the same way
    start_local_ray(num_cpus=4, include_dashboard=False)
    engine = LLM(model="tiny-random", **COMMON)
    yield engine
    engine.shutdown()
    ray.shutdown()
    if old is None:
        os.environ.pop("KVRAY_CACHE")
    else:
        os.environ["KVRAY_CACHE"] = old


def hf_greedy(model_dir: str, ids: list[int], n: int) -> list[int]:
    model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    return H.hf_greedy(model, ids, n).tokens


def wait_idle(llm: LLM) -> dict:
    for _ in range(600):
        stats = llm.stats()[0]
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"the engine never went idle: {stats}")


def test_greedy_text_equals_hf(llm) -> None:
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == list(PROMPT.encode())
    assert c.token_ids == hf_greedy(llm.model_dir, out.prompt_token_ids, NEW)
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True) and c.finish_reason == "length"


def test_stop_string_across_tokens_cuts_and_aborts_in_the_engine(llm) -> None:
    full = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    text = full.text
    start = next(i for i in range(2, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]  # three characters: at least three tokens
    steps_before = wait_idle(llm)["num_steps"]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, stop=["never seen", stop])
    cut, kept = llm.generate(
        [PROMPT, PROMPT],
        [long, SamplingParams(**{**long.__dict__, "include_stop_str_in_output": True})],
        use_tqdm=False,
    )
    first = text.find(stop)
    assert (cut.outputs[0].text, cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == (
        text[:first],
        "stop",
        stop,
    )
    assert kept.outputs[0].text == text[: first + len(stop)]
    tok = llm.get_tokenizer()
    upto = next(
        k for k in range(len(full.token_ids) + 1) if stop in tok.decode(full.token_ids[:k], skip_special_tokens=True)
    )
    assert cut.outputs[0].token_ids == kept.outputs[0].token_ids == full.token_ids[:upto]
    # Aborted in the engine: it stopped stepping long before max_tokens.
    assert wait_idle(llm)["num_steps"] - steps_before < 100


def test_n_samples_with_derived_seeds_share_the_prompt(llm) -> None:
    hits = llm.stats()[0]["prefix_cache_hits"]
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # distinct seeds, distinct samples
    assert llm.stats()[0]["prefix_cache_hits"] > hits  # the children reused the prompt's blocks
    # Child k is the sample seeded 7 + k, reproducibly.
    singles = llm.generate(
        [PROMPT] * 3, [SamplingParams(**{**sp.__dict__, "n": 1, "seed": 7 + k}) for k in range(3)], use_tqdm=False
    )
    assert [s.outputs[0].token_ids for s in singles] == [c.token_ids for c in out.outputs]


def test_chat_equals_hf_rendering(llm) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"}]
    hf = transformers.AutoTokenizer.from_pretrained(llm.model_dir)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert (chat.prompt, chat.prompt_token_ids) == (text, ids)
    plain = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    both = llm.chat([messages, messages[1:]], GREEDY, use_tqdm=False)
    assert len(both) == 2 and both[0].outputs[0].token_ids == chat.outputs[0].token_ids


def test_defaults_and_unsupported_requests(llm) -> None:
    # tiny-random's generation_config.json sets no sampling field: vLLM's defaults (temperature 1.0).
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (1.0, 1.0, 0, 1.0, 16)
    out = llm.generate([PROMPT], use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) >= 1
    if not engine_computes_logprobs():
        bad = llm.generate([PROMPT], SamplingParams(logprobs=2), use_tqdm=False)[0]
        assert bad.outputs[0].finish_reason == "error" and "SamplingParams.logprobs" in bad.error


@pytest.mark.skipif(not engine_computes_logprobs(), reason="needs the sampler's logprobs in EngineCoreOutput")
def test_logprobs_equal_hf_log_softmax(llm) -> None:
    prompt = "Logprobs, checked against HF in float32"  # unseen here: no prefix-cache hit skips its logits
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    c, p = out.outputs[0], out.prompt_token_ids
    ids = p + c.token_ids
    model = transformers.Qwen3ForCausalLM.from_pretrained(llm.model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i, pos in enumerate(c.logprobs):
        row, tok = lsm[len(p) - 1 + i], c.token_ids[i]
        assert pos[tok].rank == 1 and abs(pos[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(5)
        assert {t: r for t, r in ((t, v.rank) for t, v in pos.items())} == {
            int(t): r for r, t in enumerate(top.indices.tolist(), start=1)
        }
        assert all(
            abs(pos[int(t)].logprob - v) < 1e-4 for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        )
        assert pos[tok].decoded_token == llm.get_tokenizer().decode([tok], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(
        sum(pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for j in range(1, len(p)):
        row, own = lsm[j - 1], out.prompt_logprobs[j][p[j]]
        assert abs(own.logprob - row[p[j]].item()) < 1e-4
        assert own.rank == 1 + int((row > row[p[j]]).sum())
