"""The server's request guards without Ray: API key, media type, body limit, JSON decoding, error bodies
that never echo unbounded input, request parsing of what clients really send, prompt encoding off the
event loop, the replica's gRPC bind, a port already in use, and the ingress module's layout."""

import ast
import asyncio
import inspect
import socket
import sys
import threading

import pytest

import cluster.serve.ingress as ingress_module
from cluster.config import ConfigError, load_config
from cluster.serve import loopback
from cluster.serve.app import PortInUse, check_port_free
from cluster.serve.errors import MAX_MESSAGE_CHARS, APIError, clip, error_body
from cluster.serve.http_guard import (
    API_KEY_ENV,
    check_api_key,
    check_media_type,
    decode_json,
    read_body,
    resolve_api_key,
)
from cluster.serve.prompts import PromptEncoder
from cluster.serve.protocol import CHAT, COMPLETIONS, parse_request
from kvcore.request import SamplingParams
from tests.ports import free_port

DEFAULTS = SamplingParams(temperature=1.0, max_tokens=16)
MSGS = [{"role": "user", "content": "Hi"}]


def status(fn, *a):
    with pytest.raises(APIError) as e:
        fn(*a)
    return e.value


# ---- the requests clients really send -------------------------------------------------------------
def test_chat_max_tokens_absent_null_or_by_its_new_name():
    assert not parse_request(CHAT, {"messages": MSGS}, DEFAULTS).max_tokens_given
    assert not parse_request(CHAT, {"messages": MSGS, "max_tokens": None}, DEFAULTS).max_tokens_given
    r = parse_request(CHAT, {"messages": MSGS, "max_completion_tokens": 3, "max_tokens": 9}, DEFAULTS)
    assert r.max_tokens_given and r.params.max_tokens == 3
    r = parse_request(CHAT, {"messages": MSGS, "max_completion_tokens": None, "max_tokens": 5}, DEFAULTS)
    assert r.params.max_tokens == 5


def test_a_list_of_prompts_is_a_batch():
    r = parse_request(COMPLETIONS, {"prompt": ["a", "b"]}, DEFAULTS)
    assert [(p.text, p.token_ids) for p in r.prompts] == [("a", None), ("b", None)] and r.num_prompts == 2
    r = parse_request(COMPLETIONS, {"prompt": [[1, 2], [3]]}, DEFAULTS)
    assert [p.token_ids for p in r.prompts] == [[1, 2], [3]]
    assert [p.token_ids for p in parse_request(COMPLETIONS, {"prompt": [1, 2]}, DEFAULTS).prompts] == [[1, 2]]


@pytest.mark.parametrize("prompt", ["", [], [""], ["ok", ""], [[]], None, 5])
def test_an_empty_or_missing_prompt_is_a_400_naming_it(prompt):
    e = status(parse_request, COMPLETIONS, {"prompt": prompt}, DEFAULTS)
    assert e.status == 400 and e.param == "prompt", e.message


@pytest.mark.parametrize(
    "endpoint,body,param",
    [
        (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (COMPLETIONS, {"prompt": "x", "best_of": 2}, "best_of"),
        (COMPLETIONS, {"prompt": "x", "n": 3, "best_of": 3}, "best_of"),
        (CHAT, {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages"),
        (COMPLETIONS, {"prompt": "x", "model": "\ud800"}, "model"),
        (COMPLETIONS, {"prompt": "x", "stop": ["\ud800"]}, "stop"),
        (COMPLETIONS, {"prompt": "x", "user": [[[]]]}, "user"),
    ],
)
def test_refusals_name_their_field(endpoint, body, param):
    e = status(parse_request, endpoint, body, DEFAULTS)
    assert e.status == 400 and e.param == param and param in e.message, e.message


def test_best_of_one_is_the_default_and_accepted():
    assert parse_request(COMPLETIONS, {"prompt": "x", "best_of": 1}, DEFAULTS).params.n == 1


# ---- error bodies --------------------------------------------------------------------------------
def test_error_bodies_are_bounded_and_encodable():
    assert clip("m" * 10) == repr("m" * 10)
    assert len(clip("m" * 1_000_000)) < 200 and "1,000,002 characters" in clip("m" * 1_000_000)
    body = error_body(400, "x" * 1_000_000, param="y" * 1_000_000)["error"]
    assert len(body["message"]) < MAX_MESSAGE_CHARS + 100 and len(body["param"]) <= 80
    body = error_body(400, "bad \ud800 here", param="\udfff")["error"]
    body["message"].encode("utf-8"), body["param"].encode("utf-8")  # no lone surrogate left to fail on


# ---- the HTTP guard ------------------------------------------------------------------------------
def test_the_api_key_from_the_config_or_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert resolve_api_key(None) == "env-key" and resolve_api_key("cfg-key") == "cfg-key"
    check_api_key({}, None)  # no key: an open server
    check_api_key({"authorization": "Bearer k1"}, "k1")
    check_api_key({"authorization": "bearer  k1"}, "k1")
    for headers in ({}, {"authorization": "Bearer k2"}, {"authorization": "Basic k1"}, {"authorization": "k1"}):
        e = status(check_api_key, headers, "k1")
        assert e.status == 401 and e.code == "invalid_api_key" and "k1" not in e.message


def test_the_api_key_and_body_limit_config_fields():
    cfg = load_config("configs/local.yaml", {"serve.api_key": "s3cret"})
    assert cfg.serve.api_key == "s3cret" and "s3cret" not in repr(cfg)
    assert cfg.serve.max_request_body_bytes == 8 << 20
    for field, bad in (("api_key", ""), ("api_key", " k"), ("max_request_body_bytes", 10), ("api_key", "a\nb")):
        with pytest.raises(ConfigError, match=field):
            load_config("configs/local.yaml", {f"serve.{field}": bad})


@pytest.mark.parametrize(
    "content_type,ok",
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("text/plain", False),
        ("text/plain; charset=application/json", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        ("application/jsonx", False),
        (None, False),
    ],
)
def test_only_application_json_is_taken(content_type, ok):
    headers = {} if content_type is None else {"content-type": content_type}
    if ok:
        check_media_type(headers)
    else:
        assert status(check_media_type, headers).status == 415


def test_the_body_limit_is_checked_before_reading_it_whole():
    read = []

    async def chunks(n, size):
        for _ in range(n):
            read.append(size)
            yield b"x" * size

    async def body(headers, n, size, limit):
        return await read_body(headers, chunks(n, size), limit)

    e = status(asyncio.run, body({"content-length": str(10 << 20)}, 10, 1 << 20, 1 << 20))
    assert e.status == 413 and read == []  # refused by its declared size, nothing read
    e = status(asyncio.run, body({}, 100, 1 << 16, 1 << 18))
    assert e.status == 413 and sum(read) <= (1 << 18) + (1 << 16)  # chunked: stops once past the limit
    assert asyncio.run(body({"content-length": "6"}, 2, 3, 100)) == b"xxxxxx"
    assert status(asyncio.run, body({"content-length": "x"}, 1, 1, 100)).status == 400


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b"{not json", b'{"a": "\xff"}', b""])
def test_json_that_does_not_parse_is_a_400(raw):
    assert status(decode_json, raw).status == 400


# ---- prompts off the event loop -------------------------------------------------------------------
class FakeTokenizer:
    model_dir = None

    def __init__(self):
        self.threads, self.texts = [], []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.get_ident())
        self.texts.append(text)
        return [7] * len(text.split())


def test_prompts_are_tokenized_off_the_loop_and_long_texts_refused_before(monkeypatch):
    import cluster.serve.prompts as prompts

    monkeypatch.setattr(prompts, "max_token_chars", lambda tok: 4)
    tok = FakeTokenizer()
    enc = PromptEncoder(tok, max_model_len=100)  # at most 400 characters

    async def run(body):
        return threading.get_ident(), await enc.encode(parse_request(COMPLETIONS, body, DEFAULTS))

    loop_thread, out = asyncio.run(run({"prompt": ["a b c", [1, 2]]}))
    assert out == [("a b c", [7, 7, 7]), (None, [1, 2])]
    assert tok.threads and loop_thread not in tok.threads
    e = status(asyncio.run, run({"prompt": "x " * 4_000_000}))
    assert e.param == "prompt" and "refused before tokenizing" in e.message and len(tok.texts) == 1
    e = status(asyncio.run, run({"prompt": "w " * 150}))  # 400 characters but 150 tokens >= 100
    assert e.param == "prompt" and "max_model_len=100" in e.message
    e = status(asyncio.run, run({"prompt": "   "}))  # no tokens at all
    assert e.param == "prompt" and "no tokens" in e.message


def test_the_tokenizer_lets_other_threads_run_while_it_encodes():
    """The server tokenizes in a worker thread: that frees its event loop only if the tokenizer releases
    the GIL (tokenizers' encode held it for a 4 MB prompt's 4-9 s; encode_batch releases it). With a long
    switch interval a thread gives up the GIL only when it blocks or releases it itself, so this thread
    runs while the other encodes only if the encoding releases it."""
    from actors.models.model_dir import resolve_model_dir
    from cluster.client.tokenizer import load_tokenizer_if_present

    tok = load_tokenizer_if_present(resolve_model_dir("tiny-random"))
    text = "hello world, this is a test. \u00e9\u2603\n" * 10_000
    started, done = threading.Event(), threading.Event()

    def encode():
        started.set()
        tok.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        worker.start()
        started.wait()
        ran_while_encoding = not done.is_set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert ran_while_encoding
    assert tok.encode("Hi \u00e9") == tok.backend.encode("Hi \u00e9").ids  # the same ids as tokenizers' encode


def test_text_prompts_without_a_tokenizer_are_refused():
    enc = PromptEncoder(None, max_model_len=100)
    req = parse_request(COMPLETIONS, {"prompt": "Hi"}, DEFAULTS)
    assert status(asyncio.run, enc.encode(req)).status == 400
    assert asyncio.run(enc.encode(parse_request(COMPLETIONS, {"prompt": [1]}, DEFAULTS))) == [(None, [1])]


# ---- start-up ------------------------------------------------------------------------------------
def test_the_replica_grpc_server_binds_loopback(monkeypatch):
    from ray.serve._private import replica

    assert loopback.loopback_address("[::]:0") == "127.0.0.1:0"
    assert loopback.loopback_address("0.0.0.0:9000") == "127.0.0.1:9000"
    assert loopback.loopback_address("10.0.0.2:5") == "10.0.0.2:5"
    seen = []
    monkeypatch.setattr(replica, "add_port_to_grpc_server", lambda server, address: seen.append(address) or 1)
    assert loopback.bind_internal_grpc_to_loopback() and loopback.bind_internal_grpc_to_loopback()  # idempotent
    replica.add_port_to_grpc_server(None, "[::]:0")  # as the replica calls it once its constructor ran
    assert seen == ["127.0.0.1:0"]


def test_a_port_in_use_fails_at_once_naming_it(capsys):
    import ray

    from cluster.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))  # below the ephemeral range: still free once closed, on a busy host
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port}"):
            check_port_free("127.0.0.1", port)
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"port {port}" in err and "already in use" in err and "Traceback" not in err
    assert not ray.is_initialized()  # refused before Ray started
    check_port_free("127.0.0.1", port)  # free again


def test_every_helper_of_the_ingress_is_defined_above_its_class():
    """@serve.ingress pickles the routes while the module is imported: a name defined below the class is
    missing in the Serve replica (a chat request without max_tokens was a NameError there)."""
    tree = ast.parse(inspect.getsource(ingress_module))
    last = tree.body[-1]  # nothing (a function, a constant) after the class
    assert isinstance(last, ast.ClassDef) and last.name == "OpenAIServer", ast.dump(last)[:200]


def test_kvray_info_never_prints_the_api_key():
    from cluster.config import EngineConfig
    from cluster.info import shown_config

    shown = shown_config(EngineConfig().replace(**{"serve.api_key": "sk-secret-123"}))
    assert shown["serve"]["api_key"] == "<set>"
    assert "sk-secret-123" not in repr(shown)
    assert shown_config(EngineConfig())["serve"]["api_key"] is None
