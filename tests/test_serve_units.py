"""The server's pure parts, without Ray: request parsing (OpenAI fields -> SamplingParams, errors naming
the field), the KV-aware router, and the error bodies."""

import pytest

from cluster.serve.errors import APIError, field_of
from cluster.serve.kv_index import prompt_keys
from cluster.serve.protocol import CHAT, COMPLETIONS, parse_request
from cluster.serve.router import KVAwareRouter
from kvcore.kv_cache.block_pool import CacheEvents, event_key
from kvcore.kv_cache.hashing import compute_block_hashes
from kvcore.request import SamplingParams

DEFAULTS = SamplingParams(temperature=1.0, max_tokens=16)


def test_completion_fields_map_to_sampling_params():
    r = parse_request(
        COMPLETIONS,
        {
            "model": "m",
            "prompt": ["Hi"],
            "max_tokens": 5,
            "n": 2,
            "seed": 3,
            "stop": "x",
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "presence_penalty": 0.5,
        },
        DEFAULTS,
    )
    p = r.params
    assert (r.prompts[0].text, r.stream, r.include_usage, r.max_tokens_given) == ("Hi", True, True, True)
    assert (p.max_tokens, p.n, p.seed, p.stop, p.logprobs, p.ignore_eos, p.presence_penalty, p.temperature) == (
        5,
        2,
        3,
        ["x"],
        2,
        True,
        0.5,
        1.0,
    )
    ids = parse_request(COMPLETIONS, {"prompt": [1, 2, 3]}, DEFAULTS)
    assert ids.prompts[0].token_ids == [1, 2, 3] and ids.params.max_tokens == 16


def test_chat_fields_map_to_sampling_params():
    r = parse_request(
        CHAT,
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
        },
        DEFAULTS,
    )
    assert r.chat and r.params.max_tokens == 7 and r.params.logprobs == 3 and r.messages[0]["content"] == "Hi"
    assert (
        parse_request(
            CHAT, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}, DEFAULTS
        ).params.logprobs
        == 0
    )
    assert not parse_request(CHAT, {"messages": [{"role": "user", "content": "x"}]}, DEFAULTS).max_tokens_given


@pytest.mark.parametrize(
    "endpoint,body,param,needle",
    [
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p", "SamplingParams.top_p=0"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens", "SamplingParams.max_tokens=-1"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream", "must be a bool"),
        (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs", "integer in [0, 20]"),
        (COMPLETIONS, {"prompt": "x", "echo": True}, "echo", "not supported"),
        (COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 2}, "best_of", "best_of is not supported"),
        (COMPLETIONS, {"prompt": ["a", 5]}, "prompt", "list of token ids"),
        (COMPLETIONS, {"prompt": "x", "bogus": 1}, "bogus", "unknown field"),
        (COMPLETIONS, [1, 2], None, "JSON object"),
        (CHAT, {"messages": []}, "messages", "non-empty list"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs", "must be a bool"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "tools"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(endpoint, body, param, needle):
    with pytest.raises(APIError) as e:
        parse_request(endpoint, body, DEFAULTS)
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["param"] == param and needle in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_field_of_reads_the_field_from_validation_messages():
    assert field_of("SamplingParams.temperature=-1: must be ...") == "temperature"
    assert field_of("body.stream_options.include_usage=1: must be a bool") == "stream_options"
    assert field_of("something else") is None
    e = APIError(503, "full", code="overloaded", retry_after_s=2)
    assert e.headers() == {"Retry-After": "2"} and e.body()["error"]["type"] == "service_unavailable_error"


def test_prompt_keys_are_the_engines_block_hashes_of_full_blocks_only():
    a, b = prompt_keys(list(range(40)), 16), prompt_keys(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block does not count
    assert prompt_keys([5] + list(range(1, 32)), 16)[1] != a[1]  # block 2's hash covers block 1 too
    assert a == [event_key(h) for h in compute_block_hashes(list(range(32)), 16)]


def test_router_sends_a_family_to_the_replica_whose_cache_holds_it():
    r = KVAwareRouter(3, 4, max_blocks_per_replica=100, imbalance_threshold=4)
    family = list(range(100, 116))
    # Replica 2's engine reports the family's blocks cached (its poll's cache events).
    r.apply(2, [CacheEvents(stored=prompt_keys(family + [1, 2, 3, 4], 4))])
    assert r.choose(family + [7, 8], [1, 0, 0], [True] * 3) == 2  # the prefix is there
    assert r.choose(family + [7, 8], [0, 0, 4], [True] * 3) == 2  # within the imbalance threshold
    assert r.choose(family + [7, 8], [0, 0, 5], [True] * 3) == 0  # overloaded: least outstanding wins
    # Replica 0 took the family while 2 was overloaded, so it holds it now too; 2 (full or down) never.
    assert r.choose(family + [7, 8], [1, 0, 0], [True, True, False]) == 0
    assert r.choose(family, [0, 0, 0], [False] * 3) is None
    assert r.num_cache_routes == 3 and r.num_overloaded == 1
    # Evicted there: the index forgets it, and a new prompt goes to the least loaded, fewest blocks held.
    r.apply(2, [CacheEvents(removed=prompt_keys(family, 4)[:1])])
    assert r.index.match(2, prompt_keys(family, 4)) == 0
    r.index.forget(1)
    assert r.choose([9] * 16, [2, 0, 0], [True] * 3) == 1
    off = KVAwareRouter(3, 4, 100, 4, prefix_affinity=False)
    off.apply(2, [CacheEvents(stored=prompt_keys(family, 4))])
    assert off.choose(family, [1, 0, 0], [True] * 3) == 1


def test_router_counts_a_routed_prompt_until_the_engine_says_more():
    r = KVAwareRouter(2, 4, max_blocks_per_replica=2, imbalance_threshold=8)
    fam = list(range(8))
    first = r.choose(fam, [0, 0], [True, True])
    assert r.choose(fam + [1], [0, 1], [True, True]) == first  # a sibling arriving before any event
    r.apply(first, [CacheEvents(reset=True)])  # the engine restarted empty
    assert r.index.match(first, prompt_keys(fam, 4)) == 0
    r.forget(first)
    assert r.index.size(first) == 0


def test_kvray_serve_refuses_bad_arguments_before_ray_starts(capsys):
    from cluster.cli import main

    assert main(["serve", "--port", "0"]) == 2
    assert "--port=0: must be in [1, 65535]" in capsys.readouterr().err
    assert main(["serve", "--set", "serve.max_queued_requests=-1"]) == 2
    assert "serve.max_queued_requests=-1" in capsys.readouterr().err


def test_the_app_builder_for_serve_run():
    from ray.serve import Application

    from cluster.config import load_config
    from cluster.serve.app import build_app, deployment_options

    app = build_app({"config": "configs/local.yaml", "set": "serve.max_queued_requests=3,scheduler.max_num_seqs=5"})
    assert isinstance(app, Application)
    opts = deployment_options(
        load_config("configs/local.yaml", ["serve.max_queued_requests=3", "scheduler.max_num_seqs=5"])
    )
    assert opts["max_ongoing_requests"] > 5 + 3 and opts["num_replicas"] == 1  # Serve's bound above ours
    with pytest.raises(ValueError, match="unknown argument"):
        build_app({"confg": "configs/local.yaml"})
