"""Chat templates render exactly as HF's apply_chat_template renders them: real templates (Qwen2.5 with
tools, Llama-3 with its bos_token), the tiny-random model's own, and the sandbox refusing escapes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import transformers

from actors.models.tiny_random import ensure_tiny_random
from cluster.client.chat import (
    ChatTemplateError,
    as_conversations,
    load_chat_template,
    render_chat,
    resolve_chat_template,
    special_tokens,
)
from cluster.client.tokenizer import Tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")
QWEN = open(os.path.join(DATA, "qwen2_5_chat_template.jinja")).read()
LLAMA3 = open(os.path.join(DATA, "llama3_chat_template.jinja")).read()

SIMPLE = [{"role": "user", "content": "Hello there! 世界"}]
MULTI = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": " Hi \n"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add <two> numbers & more",
            "parameters": {"type": "object", "properties": {"a": {"type": "int"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "add 1 and 2"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
    },
    {"role": "tool", "content": "3"},
    {"role": "tool", "content": "done"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return ensure_tiny_random(str(tmp_path_factory.mktemp("cache")))


def model_with(tmp_path, model_dir: str, **tokenizer_config) -> str:
    """A copy of the tiny-random tokenizer files with tokenizer_config.json entries changed."""
    out = str(tmp_path / "m")
    os.makedirs(out)
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(os.path.join(model_dir, name), out)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg.update(tokenizer_config)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def hf_render(path: str, conv, **kwargs) -> str:
    hf = transformers.AutoTokenizer.from_pretrained(path)
    return hf.apply_chat_template(conv, tokenize=False, **kwargs)


@pytest.mark.parametrize("conv, tools", [(SIMPLE, None), (MULTI, None), (TOOL_CHAT, TOOLS), (MULTI, TOOLS)])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_template_equals_hf(tmp_path, model_dir, conv, tools, add_generation_prompt) -> None:
    path = model_with(tmp_path, model_dir, chat_template=QWEN)
    ours = render_chat(
        as_conversations(conv)[0][0],
        load_chat_template(path),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokens=special_tokens(path),
    )
    assert ours == hf_render(path, conv, tools=tools, add_generation_prompt=add_generation_prompt)
    tok = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.encode(ours, add_special_tokens=False) == hf(ours, add_special_tokens=False)["input_ids"]


def test_llama3_template_sees_the_special_tokens_as_hf_does(tmp_path, model_dir) -> None:
    bos = {"__type": "AddedToken", "content": "<|im_start|>", "special": True}
    path = model_with(tmp_path, model_dir, chat_template=LLAMA3, bos_token=bos)
    ours = render_chat(MULTI, load_chat_template(path), tokens=special_tokens(path))
    assert ours.startswith("<|im_start|><|start_header_id|>system")
    assert ours == hf_render(path, MULTI, add_generation_prompt=True)


def test_tiny_random_ships_a_template_equal_to_hf(model_dir) -> None:
    template = resolve_chat_template(model_dir, None)
    ours = render_chat(MULTI, template, tokens=special_tokens(model_dir))
    assert ours.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ours == hf_render(model_dir, MULTI, add_generation_prompt=True)


def test_template_sources(tmp_path, model_dir) -> None:
    named = model_with(
        tmp_path, model_dir, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    )
    assert load_chat_template(named) == "D"
    with open(os.path.join(named, "chat_template.jinja"), "w") as f:
        f.write("J")
    assert load_chat_template(named) == "J"  # the separate file wins, as in HF
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(None, str(file)) == "{{ messages[0]['content'] }}"
    none = model_with(tmp_path / "x", model_dir, chat_template=None)
    with pytest.raises(ChatTemplateError, match="has no chat template .*pass chat_template="):
        resolve_chat_template(none, None)


def test_sandbox_and_errors() -> None:
    with pytest.raises(ChatTemplateError, match="access to attribute '__class__'"):
        render_chat(SIMPLE, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="only user roles"):
        render_chat(SIMPLE, "{{ raise_exception('only user roles') }}")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat(SIMPLE, "{% for %}")
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.role=None"):
        as_conversations([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\[0\]='x': a message must be a dict"):
        as_conversations([SIMPLE, ["x"]])
    convs, batched = as_conversations(
        [[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]]
    )
    assert batched and convs[0][0]["content"] == "a\nb"
    assert render_chat(SIMPLE, "{{ {'a': '<&>'} | tojson }}") == '{"a": "<&>"}'  # no HTML escaping, as HF


PREFILL = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour is "},  # trailing space: HF keeps what the template keeps
]


@pytest.mark.parametrize("template", ["tiny-random", "qwen", "llama3"])
@pytest.mark.parametrize("final", ["The colour is ", "  Blue", "Red"])
def test_continue_final_message_equals_hf(tmp_path, model_dir, template, final) -> None:
    path = model_dir
    if template != "tiny-random":
        extra = {"bos_token": "<|im_start|>"} if template == "llama3" else {}
        path = model_with(tmp_path, model_dir, chat_template=QWEN if template == "qwen" else LLAMA3, **extra)
    conv = [PREFILL[0], {"role": "assistant", "content": final}]
    ours = render_chat(
        conv,
        load_chat_template(path),
        add_generation_prompt=False,
        continue_final_message=True,
        tokens=special_tokens(path),
    )
    hf = transformers.AutoTokenizer.from_pretrained(path)
    want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ours == want
    assert ours.rstrip().endswith(final.strip()) and "<|im_end|>" not in ours[ours.rindex(final.strip()) :]


def test_continue_final_message_rules(model_dir) -> None:
    template = load_chat_template(model_dir)
    with pytest.raises(ChatTemplateError, match="continue_final_message=True and add_generation_prompt=True"):
        render_chat(PREFILL, template, continue_final_message=True)  # add_generation_prompt defaults to True
    with pytest.raises(ChatTemplateError, match="continue_final_message=1: must be a bool"):
        render_chat(PREFILL, template, add_generation_prompt=False, continue_final_message=1)
    with pytest.raises(ChatTemplateError, match="the final message has no text to continue"):
        render_chat(
            [{"role": "assistant", "content": None}],
            "{{ messages[0].role }}",
            add_generation_prompt=False,
            continue_final_message=True,
        )
    # A template whose own code fails (here on a None content) is named, not a raw TypeError.
    with pytest.raises(ChatTemplateError, match="chat template: TypeError"):
        render_chat([{"role": "assistant", "content": None}], template)
    with pytest.raises(ChatTemplateError, match="does not appear in the chat"):
        render_chat(PREFILL, "{{ 'x' }}", add_generation_prompt=False, continue_final_message=True)
    # Off, the same text as before: the final message closed by the template.
    closed = render_chat(PREFILL, template, add_generation_prompt=False)
    assert closed.endswith("The colour is <|im_end|>\n")


def test_the_server_takes_continue_final_message() -> None:
    from cluster.serve.errors import APIError
    from cluster.serve.protocol import CHAT, parse_request
    from kvcore.request import SamplingParams

    body = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    assert parse_request(CHAT, body, SamplingParams()).continue_final_message
    assert not parse_request(CHAT, {"messages": PREFILL}, SamplingParams()).continue_final_message
    with pytest.raises(APIError, match="continue_final_message=true needs add_generation_prompt=false"):
        parse_request(CHAT, {"messages": PREFILL, "continue_final_message": True}, SamplingParams())
    with pytest.raises(APIError, match="continue_final_message='yes': must be a bool"):
        parse_request(CHAT, {**body, "continue_final_message": "yes"}, SamplingParams())
