"""`kvray serve` through the official `openai` client, on one server shared by the module (local Ray,
127.0.0.1 only, two CPU replicas of tiny-random): completions, chat, streaming, n, logprobs, stop,
seeds, usage, errors, greedy equal to LLM.generate, back-pressure, a client disconnect, and a load
test with a worker kill."""

import asyncio
import json
import threading
import time

import openai
import pytest
import ray
import requests

from cluster.llm import LLM
from cluster.replicas.placement import connect
from cluster.serve.app import start_server, stop_server
from cluster.stress.report import leaked_blocks
from kvcore.request import SamplingParams
from tests.serve_helpers import drivers, free_port, percentiles, serve_config, wait_pool_whole
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-random"
PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "1 2 3 4"]


CHAT = [{"role": "user", "content": "Say hi."}]


def offline_reference(config, box):
    """LLM.generate's and LLM.chat's greedy texts (one replica of the same config), into box."""
    try:
        llm = LLM(config=config.replace(data_parallel_size=1))
        try:
            sp = SamplingParams(temperature=0, max_tokens=8)
            box["generate"] = [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
            box["chat"] = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0].text
        finally:
            llm.shutdown()
    except BaseException as e:  # noqa: BLE001 - handed to the test that reads it
        box["error"] = e


@pytest.fixture(scope="module")
def server():
    config = serve_config()
    port = free_port()
    # The offline reference starts beside the server (one Ray, started here), so that their start-ups,
    # mostly waits on new processes, overlap.
    started = connect(config)
    reference: dict = {}
    thread = threading.Thread(target=offline_reference, args=(config, reference), daemon=True)
    try:
        thread.start()
        start_server(config, "127.0.0.1", port)
        thread.join(240)
        yield f"http://127.0.0.1:{port}", config, reference
    finally:
        stop_server(started)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def stream_text(chunks):
    texts, finish, usage = {}, {}, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(server[0] + "/health", timeout=30).status_code == 200
    r = requests.get(server[0] + "/metrics", timeout=30)
    assert r.status_code == 200 and "kvray_serve_replica_outstanding_requests" in r.text
    # Both engine replicas' own figures: the ingress learns of the second from the fleet, and a stats call
    # may time out on a loaded host, so /metrics may lack it for a moment, never for good.
    wait_until(
        lambda: 'kvray_engine_kv_cache_usage{replica="1"}' in requests.get(server[0] + "/metrics", timeout=30).text,
        120,
        step=lambda: time.sleep(1.0),
        what="replica 1's engine figures in /metrics",
    )


def test_greedy_equals_llm_generate_and_chat(server, client):
    got = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in PROMPTS
    ]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    want = server[2]
    if "error" in want:
        raise want["error"]
    assert got == want["generate"]
    assert chat.choices[0].message.content == want["chat"] and chat.choices[0].message.role == "assistant"


def test_logits_processors_and_continue_final_message(client):
    """vLLM's extras through the server: allowed_token_ids, logit_bias, bad_words (tokenized by the server),
    and a chat whose last assistant message the model continues (the same text as completing the rendered
    prompt)."""
    kw = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    ab = client.completions.create(**kw, extra_body={"allowed_token_ids": list(b"ab")}).choices[0].text
    assert set(ab) <= {"a", "b"} and len(ab) == 8
    no_ab = client.completions.create(**kw, extra_body={"allowed_token_ids": list(b"ab"), "bad_words": ["ab"]})
    assert "ab" not in no_ab.choices[0].text and set(no_ab.choices[0].text) <= {"a", "b"}
    assert client.completions.create(**kw, logit_bias={str(ord("q")): 100}).choices[0].text == "q" * 8
    conv = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi, I am"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    chat = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, temperature=0, extra_body=extra)
    rendered = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi, I am"
    assert chat.choices[0].message.content == client.completions.create(**{**kw, "prompt": rendered}).choices[0].text
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=MODEL, messages=conv, max_tokens=2, extra_body={"continue_final_message": True}
        )


def test_streaming_equals_whole_with_n_seed_usage(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=10, n=2, temperature=1.0, seed=7)
    whole = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert [c.text for c in whole.choices] == [c.text for c in again.choices]  # seeded: reproducible
    texts, finish, usage = stream_text(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 20 and usage.prompt_tokens == whole.usage.prompt_tokens
    chat_kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    whole_chat = client.chat.completions.create(**chat_kw)
    texts, finish, _ = stream_text(client.chat.completions.create(**chat_kw, stream=True))
    assert texts == {0: whole_chat.choices[0].message.content} and finish == {0: "length"}


def test_stop_strings_whole_and_streamed(client):
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0).choices[0].text
    stop = next(ch for ch in base[3:] if ch != "\ufffd")
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0, stop=[stop])
    c = r.choices[0]
    assert c.text == base[: base.index(stop)] and c.finish_reason == "stop"
    assert json.loads(r.model_dump_json())["choices"][0]["stop_reason"] == stop
    texts, finish, _ = stream_text(
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0, stop=[stop], stream=True)
    )
    assert texts == {0: c.text} and finish == {0: "stop"}


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one (top_logprobs is keyed by text, and two tokens may
    # decode alike, so the sampled one's entry may hold a lower twin's value).
    assert all(v >= max(t.values()) - 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("top_p", 2.0),
        ("n", 0),
        ("max_tokens", 0),
        ("logprobs", 30),
        ("presence_penalty", 5.0),
        ("seed", "x"),
    ],
)
def test_bad_field_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", **{field: value})
    err = e.value.body
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error", err


def test_other_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="not-this-one", prompt="Hi", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError, match="max_model_len=256"):
        client.completions.create(model=MODEL, prompt=list(range(300)), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="Hi", logit_bias={"5": 1000})  # OpenAI's range: [-100, 100]
    r = requests.post(
        server[0] + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}, timeout=30
    )
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = requests.get(server[0] + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    # ... and the server goes on serving.
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_disconnect_mid_stream_aborts_and_the_pool_is_whole(server, client):
    stream = client.completions.create(
        model=MODEL,
        prompt="Tell me a long story",
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    books = wait_pool_whole()
    assert all(b["idle"] and leaked_blocks(b) == 0 and b["invariant_error"] is None for b in books), books
    stats = [ray.get(d.stats.remote(), timeout=30) for d in drivers()]
    assert sum(s["num_live_requests"] for s in stats) == 0, stats
    metrics = requests.get(server[0] + "/metrics", timeout=30).text
    assert (
        "kvray_serve_client_disconnects_total 1.0" in metrics or "kvray_serve_client_disconnects_total 2.0" in metrics
    ), [ln for ln in metrics.splitlines() if "disconnect" in ln]


def test_back_pressure_gives_503_with_retry_after_never_a_hang(server):
    capacity = 2 * (6 + 4)  # replicas x (scheduler.max_num_seqs + serve.max_queued_requests)

    async def burst():
        c = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(i):
            try:
                r = await c.completions.create(
                    model=MODEL, prompt=f"burst {i}", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
                )
                return r.choices[0].finish_reason
            except openai.APIStatusError as e:
                return (e.status_code, e.response.headers.get("retry-after"), e.body.get("code"))

        try:
            return await asyncio.gather(*[one(i) for i in range(2 * capacity + 8)])
        finally:
            await c.close()

    results = asyncio.run(burst())
    refused = [r for r in results if r != "length"]
    assert refused and all(r == (503, "1", "overloaded") for r in refused), results
    assert len(results) - len(refused) >= capacity // 2, results
    books = wait_pool_whole()
    assert all(leaked_blocks(b) == 0 for b in books), books


def test_load_with_a_worker_kill_loses_and_duplicates_nothing(server, client):
    prompts = [f"family {i % 4} shares this prefix, then request {i}" for i in range(8)]
    ref = {}
    for p in prompts:  # the reference tokens, one by one, before the load
        lp = (
            client.completions.create(
                model=MODEL, prompt=p, max_tokens=4, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .logprobs
        )
        ref[p] = lp.tokens
    n_requests, concurrency = 100, 16  # within the 2 x 10 the replicas hold: no 503 here; 75 after the kill
    done: list[int] = [0]
    ttft, tpot, results = [], [], {}

    async def load():
        c = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)
        sem = asyncio.Semaphore(concurrency)

        async def one(i):
            p = prompts[i % len(prompts)]
            async with sem:
                t0 = time.monotonic()
                stamps, tokens, finish = [], [], None
                stream = await c.completions.create(
                    model=MODEL,
                    prompt=p,
                    max_tokens=4,
                    temperature=0,
                    logprobs=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                async for ch in stream:
                    for choice in ch.choices:
                        if choice.logprobs is not None and choice.logprobs.tokens:
                            tokens += choice.logprobs.tokens
                            stamps.append(time.monotonic())
                        finish = choice.finish_reason or finish
                results[i] = (p, tokens, finish)
                ttft.append(stamps[0] - t0)
                if len(stamps) > 1:
                    tpot.append((stamps[-1] - stamps[0]) / (len(tokens) - 1))
                done[0] += 1
                if done[0] == n_requests // 4:
                    drivers()[0].kill_worker.remote(0)  # a TP worker of replica 0 dies mid-load

        try:
            await asyncio.gather(*[one(i) for i in range(n_requests)])
        finally:
            await c.close()

    asyncio.run(load())
    print(
        f"\nserve load ({n_requests} streams, {concurrency} concurrent, a worker kill): TTFT {percentiles(ttft)}, "
        f"TPOT {percentiles(tpot)}"
    )
    assert sorted(results) == list(range(n_requests))  # nothing lost
    wrong = {i: r for i, r in results.items() if r[1] != ref[r[0]] or r[2] != "length"}
    assert not wrong, list(wrong.items())[:3]  # nothing duplicated, dropped or changed by the replay
    stats = [ray.get(d.stats.remote(), timeout=30) for d in drivers()]
    assert stats[0]["worker_restarts"] == 1 and stats[1]["worker_restarts"] == 0, stats
    books = wait_pool_whole()
    assert all(b["idle"] and leaked_blocks(b) == 0 for b in books), books


def test_bench_serve_sweep_runs_against_the_server(server):
    """benchmarks/e2e/bench_serve.py's client (the GPU sweep's code) on a few short requests."""
    from benchmarks.e2e import bench_serve as bench

    reqs = bench.sharegpt_like(6, 256, 0, smoke=True)
    results = asyncio.run(bench.sweep(server[0], MODEL, reqs, [8.0]))
    print("\n" + "\n".join(bench.format_row(r) for r in results))
    assert [r["rate"] for r in results][:2] == [float("inf"), 8.0] and results[2]["half_saturation"]
    for r in results:
        assert r["completed"] == 6 and r["failed"] == 0, r
        assert r["ttft_p50_ms"] is not None and r["output_tok_s"] > 0, r


def test_a_driver_death_moves_its_streams_to_the_other_replica_and_the_rest_serve_on(server, client):
    """Last in the module: replica 1 stays down. Its in-flight streams move to replica 0 and finish whole
    (tests/test_serve_migration.py checks them token by token), as do replica 0's own; new requests go
    to the replica that is left."""

    async def streams():
        c = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)
        started = asyncio.Event()

        async def one(i):
            tokens = 0
            try:
                stream = await c.completions.create(
                    model=MODEL,
                    prompt=f"stream {i} " * 3,
                    max_tokens=40,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                async for ch in stream:
                    tokens += sum(len(getattr(x, "token_ids", None) or []) for x in ch.choices)
                    started.set()
                return ("finished", tokens)
            except openai.APIError as e:
                return ("error", str(e))

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        await started.wait()
        ray.kill(drivers()[1], no_restart=True)
        try:
            return await asyncio.gather(*tasks)
        finally:
            await c.close()

    results = asyncio.run(streams())
    assert all(r == ("finished", 40) for r in results), results
    metrics = requests.get(server[0] + "/metrics", timeout=30).text
    assert 'kvray_serve_migrations{replica="1"} 0.0' not in metrics, metrics  # replica 1's streams moved
    for _ in range(3):  # replica 1 takes nothing new
        assert client.completions.create(model=MODEL, prompt="after", max_tokens=2).choices[0].finish_reason == "length"
    assert requests.get(server[0] + "/health", timeout=30).status_code == 200
    assert 'kvray_serve_replica_up{replica="1"} 0.0' in requests.get(server[0] + "/metrics", timeout=30).text
