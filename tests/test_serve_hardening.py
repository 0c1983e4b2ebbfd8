"""`kvray serve` against what clients really send and what a hostile tester sends, on one server for the
module (local Ray started here, 127.0.0.1 only, one CPU replica of tiny-random, an API key from
$KVRAY_API_KEY): chat without max_tokens, batches of prompts, the API key, media types, body limits,
deep or broken JSON, huge prompts, requests no retry could admit, and what listens beyond loopback."""

import json
import os

import openai
import pytest
import ray
import requests

from actors.messages import RequestSpec
from cluster.config import load_config
from cluster.serve.app import start_server, stop_server
from kvcore.request import SamplingParams
from tests.serve_helpers import SERVE_OVERRIDES, drivers, free_port

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-random"
KEY = "sk-kvray-test-key"
CHAT = [{"role": "user", "content": "Say hi."}]
CAPACITY = 6 + 4  # scheduler.max_num_seqs + serve.max_queued_requests (SERVE_OVERRIDES)


@pytest.fixture(scope="module")
def server():
    # One replica; a short context: a chat without max_tokens runs to max_model_len.
    overrides = {**SERVE_OVERRIDES, "parallel.data_parallel_size": 1, "model.max_model_len": 64}
    config = load_config("configs/local.yaml", overrides)
    port = free_port()
    os.environ["KVRAY_API_KEY"] = KEY  # read where the server starts, as `KVRAY_API_KEY=... kvray serve` does
    started = False
    try:
        started = start_server(config, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.environ.pop("KVRAY_API_KEY", None)
        stop_server(started)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path, body=None, key=KEY, **kw):
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if body is not None:
        kw["data"] = json.dumps(body) if isinstance(body, (dict, list)) else body
        headers.setdefault("Content-Type", "application/json")
    return requests.post(server + path, headers=headers, timeout=120, **kw)


def test_chat_without_max_tokens_whole_and_streamed(client):
    """The request most chat clients send: no max_tokens at all (it was a 500 NameError)."""
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content
    none = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=None)
    assert none.choices[0].message.content == r.choices[0].message.content
    capped = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert capped.usage.completion_tokens <= 3


def test_a_list_of_prompts_is_a_batch_indexed_per_prompt(client):
    one = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
        for p in ("Hello", "Once upon")
    ]
    batch = client.completions.create(model=MODEL, prompt=["Hello", "Once upon"], max_tokens=4, temperature=0)
    assert [(c.index, c.text) for c in batch.choices] == [(0, one[0]), (1, one[1])]
    assert batch.usage.completion_tokens == 8
    n2 = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2, temperature=0)
    assert sorted(c.index for c in n2.choices) == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=["Hello", "Once upon"], max_tokens=4, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: one[0], 1: one[1]}


@pytest.mark.parametrize("prompt", ["", [], [""], ["ok", ""]])
def test_an_empty_prompt_is_a_400(client, prompt):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert e.value.body["param"] == "prompt"


def test_the_api_key_guards_every_v1_route_and_health_stays_open(server):
    for key in (None, "wrong"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        assert requests.get(server + "/v1/models", headers=headers, timeout=30).status_code == 401
        for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
            r = post(server, path, body, key=key)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert requests.get(server + "/health", timeout=30).status_code == 200
    assert requests.get(server + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).ok


def test_only_json_bodies_are_taken(server):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    refused = [
        post(server, "/v1/completions", body, headers={"Content-Type": "text/plain"}),
        post(server, "/v1/completions", body, headers={"Content-Type": "application/x-www-form-urlencoded"}),
        post(server, "/v1/completions", files={"prompt": ("p", b"Hi")}),  # multipart/form-data
        post(server, "/v1/completions", body, headers={"Content-Type": ""}),
    ]
    assert [r.status_code for r in refused] == [415] * 4, [r.text for r in refused]
    assert all("application/json" in r.json()["error"]["message"] for r in refused)
    ok = post(server, "/v1/completions", body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_bodies_past_the_limit_are_413_and_errors_never_echo_them(server):
    limit = 8 << 20  # serve.max_request_body_bytes's default
    big = json.dumps({"prompt": "x" * (limit + 10)})
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]

    def chunks():  # no Content-Length: read as it comes, refused once past the limit
        yield big[: limit // 2].encode()
        yield big[limit // 2 :].encode()

    r = post(server, "/v1/completions", chunks())
    assert r.status_code == 413, r.text[:300]
    r = post(server, "/v1/completions", {"model": "m" * (1 << 20), "prompt": "Hi"})
    assert r.status_code == 404 and len(r.content) < 4096, len(r.content)
    r = post(server, "/v1/completions", {"prompt": "Hi", "x" * (1 << 20): 1})
    assert r.status_code == 400 and len(r.content) < 4096, len(r.content)


def test_deep_json_and_a_lone_surrogate_are_400s(server):
    r = post(server, "/v1/completions", "[" * 100_000 + "]" * 100_000)
    assert r.status_code == 400, r.text[:300]
    r = post(server, "/v1/completions", '{"prompt": "Hi", "user": ' + "[" * 900 + "]" * 900 + "}")
    assert r.status_code == 400, r.text[:300]
    raw = '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    r = post(server, "/v1/chat/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = post(server, "/v1/completions", '{"prompt": "Hi", "model": "\\udfff", "max_tokens": 1}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_a_4mb_prompt_is_refused_before_it_is_tokenized(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello world " * 350_000, max_tokens=2)
    assert e.value.body["param"] == "prompt" and "refused before tokenizing" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 1_400_000}])
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"n": CAPACITY + 1}, "n"),
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"extra_body": {"stop_token_ids": [1_000_000], "min_tokens": 2}}, "stop_token_ids"),
    ],
)
def test_requests_no_retry_could_admit_are_400s_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_top_logprobs_past_the_limit_is_named(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs" and "top_logprobs" in e.value.body["message"]


def test_the_engine_refuses_stop_ids_past_the_vocabulary_and_serves_on(server, client):
    """The engine path itself (the driver, as LLM.generate and kvray run reach it), not only the ingress."""
    sp = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[1_000_000], ignore_eos=True)
    refusals = ray.get(drivers()[0].add_requests.remote([RequestSpec("stop-past-vocab", [5, 6, 7], sp)]), timeout=60)
    assert refusals[0] is not None and "stop_token_ids" in refusals[0], refusals
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"min_tokens": 2})
    assert r.choices[0].finish_reason == "length"


def test_nothing_listens_beyond_loopback(server):
    """The embedded Ray listens on 127.0.0.1 only: the Serve replica's internal gRPC server too."""
    import ipaddress

    import psutil

    exposed = []
    for proc in psutil.Process().children(recursive=True):
        try:
            for c in proc.net_connections(kind="inet"):
                ip = ipaddress.ip_address(c.laddr.ip.split("%")[0])
                ip = getattr(ip, "ipv4_mapped", None) or ip
                if c.status == psutil.CONN_LISTEN and not ip.is_loopback:
                    exposed.append((proc.name(), " ".join(proc.cmdline()[:2]), c.laddr))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    assert exposed == [], exposed
