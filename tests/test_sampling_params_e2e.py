"""The real engine (EngineCore + LocalExecutor + model runner + the one-launch sampler) on a tiny HF
Qwen3, against HF transformers in float32 on the CPU:

- logprobs and prompt_logprobs equal HF's log_softmax within 1e-4 (own token, top-k, rank), with
  chunked prefill splitting the prompt and sync and async scheduling;
- presence / frequency / repetition penalties on greedy rows equal a direct torch implementation of
  vLLM's formulas applied to HF's logits, step by step;
- min_tokens keeps a stop token from ending the request early;
- logit_bias, allowed_token_ids and bad words on greedy rows equal vLLM's processors applied to HF's
  logits, step by step (sync and async scheduling, the torch reference and the kernels); min_p keeps
  only tokens within min_p of the top probability;
- the same fields through LLM.generate on the built-in tiny-random model (text bad words tokenized by the
  client), and best_of / out-of-vocabulary ids refused naming the field.
All requests of a scenario run in one batch, so they also show the per-row parameters stay per row.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_models as H
import pytest
import torch
from test_sampler import vllm_penalties

from actors.driver.engine_core import EngineCore
from actors.executor.local import LocalExecutor
from cluster.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvcore.request import Request, SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    return path, H.save_hf_model("qwen3", path)


def run(path: str, requests: dict[str, tuple[list[int], SamplingParams]], async_scheduling=False, use_triton=None):
    """use_triton: the runner's sampler and logprobs kernels (None: the torch references on the CPU)."""
    sched = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=24, debug_invariants=True, async_scheduling=async_scheduling
    )
    config = EngineConfig(
        model=ModelConfig(model=path, dtype="float32", seed=0),
        parallel=ParallelConfig(tensor_parallel_size=1, device="cpu"),
        cache=CacheConfig(block_size=8, num_gpu_blocks=None, cpu_kv_cache_gib=0.01),
        scheduler=sched,
    )
    executor = LocalExecutor(config)
    try:
        if use_triton is not None:
            assert executor.worker is not None and executor.worker.model_runner is not None
            executor.worker.model_runner.sampler.use_triton = use_triton
        engine = EngineCore(config, executor)
        for rid, (prompt, sp) in requests.items():
            engine.add_request(Request(rid, prompt, sp, eos_token_id=EOS))
        outs: dict[str, list] = {rid: [] for rid in requests}
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            for o in engine.step():
                assert o.error is None, f"{o.request_id}: {o.error}"
                outs[o.request_id].append(o)
        assert not engine.has_unfinished()
        return outs
    finally:
        executor.shutdown()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_rows(rows_ids, rows_lp, ranks, own: list[int], lp: torch.Tensor, k: int) -> None:
    """rows [P, 1 + k] against HF logprob rows lp [P, V] scoring tokens `own`."""
    assert rows_ids.shape == (len(own), 1 + k) and len(ranks) == len(own)
    for j, tok in enumerate(own):
        assert rows_ids[j, 0] == tok
        assert abs(float(rows_lp[j, 0]) - float(lp[j, tok])) < 1e-4
        assert int(ranks[j]) == int((lp[j] >= lp[j, tok]).sum())
        if k:
            top = lp[j].topk(k)
            assert rows_ids[j, 1:].tolist() == top.indices.tolist()
            assert torch.allclose(torch.from_numpy(rows_lp[j, 1:]), top.values, atol=1e-4)


@pytest.mark.parametrize(
    "async_scheduling,use_triton", [(False, None), (True, None), (False, True)], ids=["sync", "async", "kernels"]
)
def test_logprobs_and_prompt_logprobs_equal_hf(model, async_scheduling, use_triton):
    """kernels: the sampling and logprobs kernels (interpreted), as a GPU runs them; the prompt logprobs
    of the 47-token request come from the kernel in every chunk."""
    path, hf = model
    prompts = H.make_prompts()
    reqs = {
        # 47 prompt tokens through a 24-token budget: prompt logprobs arrive from several chunks.
        "greedy": (prompts[3][:47], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=5, prompt_logprobs=3)),
        "sampled": (
            prompts[0],
            SamplingParams(temperature=1.0, top_k=10, max_tokens=4, ignore_eos=True, seed=7, logprobs=0),
        ),
        "plain": (prompts[2], SamplingParams(max_tokens=3, ignore_eos=True)),
        "prompt-only": (prompts[0][:4], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0)),
    }
    outs = run(path, reqs, async_scheduling, use_triton)
    for rid, (prompt, sp) in reqs.items():
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        assert len(tokens) == sp.max_tokens
        lp = hf_logprobs(hf, prompt + tokens)
        if sp.logprobs is None:
            assert all(o.logprobs is None for o in outs[rid])
        else:
            rows = [o.logprobs for o in outs[rid] if o.new_token_ids]
            assert all(r is not None and len(r) == 1 for r in rows)
            ids = torch.cat([torch.from_numpy(r.token_ids) for r in rows]).numpy()
            lps = torch.cat([torch.from_numpy(r.logprobs) for r in rows]).numpy()
            ranks = [int(r.ranks[0]) for r in rows]
            check_rows(ids, lps, ranks, tokens, lp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], sp.logprobs)
        with_prompt = [o.prompt_logprobs for o in outs[rid] if o.prompt_logprobs is not None]
        if sp.prompt_logprobs is None:
            assert not with_prompt
            continue
        assert len(with_prompt) == 1 and outs[rid][0].prompt_logprobs is not None  # with the first token
        p = with_prompt[0]
        check_rows(p.token_ids, p.logprobs, p.ranks, prompt[1:], lp[: len(prompt) - 1], sp.prompt_logprobs)
    greedy = [t for o in outs["greedy"] for t in o.new_token_ids]
    assert greedy == H.hf_greedy(hf, prompts[3][:47], 5).tokens


def test_penalties_equal_vllm_formulas_on_hf_logits(model):
    path, hf = model
    prompts = H.make_prompts()
    cases = {"rep": (1.4, 0.0, 0.0), "freq": (1.0, 0.0, 1.5), "pres": (1.0, 1.2, 0.0), "all": (1.2, 0.5, 0.7)}
    n = 8
    reqs = {
        rid: (
            prompts[i % 3][:20],
            SamplingParams(
                max_tokens=n, ignore_eos=True, repetition_penalty=r, presence_penalty=pr, frequency_penalty=f
            ),
        )
        for i, (rid, (r, pr, f)) in enumerate(cases.items())
    }
    reqs["plain"] = (prompts[0][:20], SamplingParams(max_tokens=n, ignore_eos=True))
    outs = run(path, reqs)
    for rid, (prompt, sp) in reqs.items():
        got = [t for o in outs[rid] for t in o.new_token_ids]
        out: list[int] = []
        for _ in range(n):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + out])).logits[0, -1:].float()

            def pad(ids):
                return torch.tensor([ids + [H.VOCAB] * (40 - len(ids))])

            pen = vllm_penalties(
                logits,
                pad(prompt),
                pad(out),
                torch.tensor([sp.presence_penalty]),
                torch.tensor([sp.frequency_penalty]),
                torch.tensor([sp.repetition_penalty]),
            )
            out.append(int(pen.argmax(-1)))
        assert got == out, rid
    assert len({tuple(t for o in outs[r] for t in o.new_token_ids) for r in reqs}) > 2  # penalties act


def test_min_tokens_holds_back_stop_tokens(model):
    path, hf = model
    prompt = H.make_prompts()[2]
    first = H.hf_greedy(hf, prompt, 1).tokens[0]
    reqs = {
        "stops": (prompt, SamplingParams(max_tokens=8, stop_token_ids=[first])),
        "held": (prompt, SamplingParams(max_tokens=8, stop_token_ids=[first], min_tokens=4)),
        "held-eos": (prompt, SamplingParams(max_tokens=6, min_tokens=6)),
    }
    outs = run(path, reqs)
    tokens = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in reqs}
    assert tokens["stops"] == [first] and outs["stops"][-1].finish_reason == "stop"
    assert len(tokens["held"]) >= 4 and first not in tokens["held"][:4]
    assert tokens["held"][4:] == [] or outs["held"][-1].finish_reason in ("stop", "length")
    assert len(tokens["held-eos"]) == 6 and EOS not in tokens["held-eos"]


def vllm_processors(logits: torch.Tensor, sp: SamplingParams, out: list[int]) -> torch.Tensor:
    """vLLM V1's order on one row: allowed_token_ids, bad words (the output's tail), logit_bias."""
    x = logits.clone()
    if sp.allowed_token_ids is not None:
        mask = torch.full_like(x, float("-inf"))
        mask[sp.allowed_token_ids] = 0.0
        x = x + mask
    for word in sp.bad_words_token_ids or []:
        if len(word) <= len(out) + 1 and (len(word) == 1 or out[-(len(word) - 1) :] == word[:-1]):
            x[word[-1]] = float("-inf")
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    return x


@pytest.mark.parametrize(
    "async_scheduling,use_triton", [(False, None), (True, None), (True, True)], ids=["sync", "async", "async-kernels"]
)
def test_logit_bias_allowed_ids_and_bad_words_equal_vllm_on_hf_logits(model, async_scheduling, use_triton):
    path, hf = model
    prompts = H.make_prompts()
    n = 6
    plain = H.hf_greedy(hf, prompts[2][:20], n).tokens
    g = plain  # bad words made of the greedy continuation, so they must bite
    reqs = {
        "plain": (prompts[2][:20], SamplingParams(max_tokens=n, ignore_eos=True)),
        "bias": (prompts[2][:20], SamplingParams(max_tokens=n, ignore_eos=True, logit_bias={g[0]: -50.0, 77: 3.0})),
        "allowed": (
            prompts[0],
            SamplingParams(max_tokens=n, ignore_eos=True, allowed_token_ids=[5, 9, 77, 120, 200], logit_bias={9: 1.0}),
        ),
        "bad": (
            prompts[2][:20],
            SamplingParams(max_tokens=n, ignore_eos=True, bad_words_token_ids=[[g[0], g[1]], [g[2], g[3], g[4]], [77]]),
        ),
        "bad-first": (prompts[2][:20], SamplingParams(max_tokens=n, ignore_eos=True, bad_words_token_ids=[[g[0]]])),
    }
    outs = run(path, reqs, async_scheduling, use_triton)
    got = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in reqs}
    assert got["plain"] == plain
    for rid, (prompt, sp) in reqs.items():
        out: list[int] = []
        for _ in range(n):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int(vllm_processors(logits, sp, out).argmax()))
        assert got[rid] == out, rid
    assert set(got["allowed"]) <= {5, 9, 77, 120, 200}
    assert got["bias"][0] != g[0] and got["bad-first"][0] != g[0]
    assert got["bad"][:2] != g[:2]


def test_min_p_keeps_tokens_near_the_top_probability(model):
    path, hf = model
    prompts = H.make_prompts()
    n = 6
    reqs = {
        # min_p = 1 keeps only the most likely token: sampling at any temperature is greedy.
        "top-only": (
            prompts[2][:20],
            SamplingParams(temperature=1.5, min_p=1.0, seed=3, max_tokens=n, ignore_eos=True),
        ),
        **{
            f"s{i}": (
                prompts[i][:20],
                SamplingParams(temperature=1.0, min_p=0.3, seed=i, max_tokens=n, ignore_eos=True),
            )
            for i in range(3)
        },
    }
    outs = run(path, reqs, async_scheduling=True)
    got = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in reqs}
    assert got["top-only"] == H.hf_greedy(hf, prompts[2][:20], n).tokens
    for rid, (prompt, sp) in reqs.items():
        with torch.no_grad():
            probs = hf(torch.tensor([prompt + got[rid]])).logits[0, len(prompt) - 1 : -1].float().softmax(-1)
        chosen = probs.gather(1, torch.tensor(got[rid]).unsqueeze(1)).squeeze(1)
        assert bool((chosen >= sp.min_p * probs.max(-1).values * (1 - 1e-5)).all()), rid


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """The built-in tiny-random model (a byte tokenizer: token id = byte) behind a local Ray."""
    import ray

    from cluster import LLM
    from cluster.replicas.placement import start_local_ray

    cache = str(tmp_path_factory.mktemp("kvray-cache"))
    old = os.environ.get("KVRAY_CACHE")
    os.environ["KVRAY_CACHE"] = cache  # the workers resolve tiny-random the same way
    start_local_ray(num_cpus=4, include_dashboard=False)
    engine = LLM(
        model="tiny-random",
        device="cpu",
        dtype="float32",
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        cpu_kv_cache_gib=0.01,
        step_timeout_s=60,
        placement_timeout_s=30,
    )
    yield engine
    engine.shutdown()
    ray.shutdown()
    if old is None:
        os.environ.pop("KVRAY_CACHE")
    else:
        os.environ["KVRAY_CACHE"] = old


def test_processors_through_llm_generate(llm):
    letters = list(b"abcdefghijklmnopqrstuvwxyz")
    prompt = "The quick brown fox"

    def sp(**kw):
        return SamplingParams(max_tokens=12, ignore_eos=True, **kw)

    params = [
        sp(allowed_token_ids=letters),
        sp(allowed_token_ids=list(b"ab")),
        sp(logit_bias={str(ord("z")): 100.0}),  # JSON's string keys, as the server passes them
        sp(temperature=1.0, min_p=1.0, seed=5),
        sp(),
        sp(logit_bias={10**6: 1.0}),
    ]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    letters_text, ab, zs, min_p, greedy, bad_id = (o.outputs[0] for o in outs)
    assert set(letters_text.text) <= set("abcdefghijklmnopqrstuvwxyz") and len(letters_text.token_ids) == 12
    assert set(ab.token_ids) <= set(b"ab") and ab.text == bytes(ab.token_ids).decode()
    assert zs.text == "z" * 12
    assert min_p.token_ids == greedy.token_ids  # min_p = 1 keeps only the top token
    assert (
        outs[-1].error is not None and "SamplingParams.logit_bias" in outs[-1].error and "vocabulary" in outs[-1].error
    )
    assert bad_id.finish_reason == "error"
    # bad_words as text: the client tokenizes them; the pair never completes anywhere in the output.
    word = letters_text.text[:2]
    out = llm.generate([prompt], sp(allowed_token_ids=letters, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert word not in out.text and len(out.token_ids) == 12
    assert out.text[:1] == word[:1]  # the first token is allowed: only the completion is banned


def test_get_tokenizer_is_hfs_class_over_the_models_files(llm):
    import transformers

    tok = llm.get_tokenizer()
    assert isinstance(tok, transformers.PreTrainedTokenizerFast) and llm.get_tokenizer() is tok
    out = llm.generate(["Hello"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert (
        out.prompt_token_ids == tok("Hello")["input_ids"]
        and tok.decode(out.outputs[0].token_ids, skip_special_tokens=True) == out.outputs[0].text
    )
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_continues_the_final_message(llm):
    from cluster.client.chat import ChatTemplateError

    conv = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi, I am"}]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    out = llm.chat(conv, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    want = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert out.prompt_token_ids == want and llm.get_tokenizer().decode(want).endswith("assistant\nHi, I am")
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ChatTemplateError, match="continue_final_message=True and add_generation_prompt=True"):
        llm.chat(conv, sp, use_tqdm=False, continue_final_message=True)
