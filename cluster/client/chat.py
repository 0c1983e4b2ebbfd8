"""Chat templates, rendered as HF's `apply_chat_template` renders them (and so as vLLM's LLM.chat does).

The template is untrusted code from the checkpoint: it runs in jinja2's ImmutableSandboxedEnvironment
with HF's settings (trim_blocks, lstrip_blocks, loop controls, a `generation` block tag, the `tojson`
filter without HTML escaping, `raise_exception`, `strftime_now`), and sees the tokenizer's special
tokens (bos_token, eos_token, ...) as variables. The rendered text is tokenized without adding special
tokens: the template already placed them.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from actors.config.hf_json import read_json_object

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """No usable chat template, a malformed conversation, or a template that failed to render."""


def _read_tokenizer_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, TOKENIZER_CONFIG)
    return read_json_object(path) if os.path.isfile(path) else {}


def load_chat_template(model_dir: str) -> str | None:
    """The model's own template: chat_template.jinja, else tokenizer_config.json's `chat_template`
    (a string, or a list of {"name", "template"} of which "default" is taken, as HF does)."""
    path = os.path.join(model_dir, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    template = _read_tokenizer_config(model_dir).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def special_tokens(model_dir: str) -> dict[str, str]:
    """bos_token, eos_token, ... as tokenizer_config.json names them (a string or an AddedToken dict)."""
    cfg = _read_tokenizer_config(model_dir)
    out: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def resolve_chat_template(model_dir: str | None, chat_template: str | None) -> str:
    """The template to use: the caller's (a template string or a path to a file), else the model's."""
    if chat_template is not None:
        if not isinstance(chat_template, str):
            raise ChatTemplateError(f"chat_template={chat_template!r}: must be a template string or a file path")
        if "{" not in chat_template and os.path.isfile(chat_template):
            with open(chat_template) as f:
                return f.read()
        return chat_template
    template = load_chat_template(model_dir) if model_dir is not None else None
    if template is None:
        raise ChatTemplateError(
            f"{model_dir}: the model has no chat template ({TOKENIZER_CONFIG} has no "
            f"'chat_template' and there is no {TEMPLATE_FILE}); pass chat_template=..."
        )
    return template


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None


def _message(index: str, m: Any) -> dict[str, Any]:
    """One message as the template sees it; text parts of a content list are joined with newlines
    (vLLM's "string" content format)."""
    if not isinstance(m, dict):
        raise ChatTemplateError(f"messages{index}={m!r}: a message must be a dict with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"messages{index}.role={role!r}: must be a non-empty string")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(
                    f"messages{index}.content[{j}]={part!r}: only text parts "
                    "({'type': 'text', 'text': ...}) are supported"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ChatTemplateError(f"messages{index}.content={content!r}: must be a string, a list of text parts, or None")
    return {**m, "content": content}


def as_conversations(messages: Any) -> tuple[list[list[dict[str, Any]]], bool]:
    """-> (conversations, batched): one conversation (a list of messages) or a list of them."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages: must be a non-empty list of messages, or a list of such lists")
    batched = isinstance(messages[0], (list, tuple))
    convs = list(messages) if batched else [messages]
    out = []
    for c, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise ChatTemplateError(f"messages[{c}]: a conversation must be a non-empty list of messages")
        prefix = f"[{c}]" if batched else ""
        out.append([_message(f"{prefix}[{i}]", m) for i, m in enumerate(conv)])
    return out, batched


def check_chat_flags(add_generation_prompt: Any, continue_final_message: Any) -> None:
    """HF's rule: a new assistant header and continuing the final message exclude each other."""
    for name, v in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(v, bool):
            raise ChatTemplateError(f"{name}={v!r}: must be a bool")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "continue_final_message=True and add_generation_prompt=True are not compatible: continue_final_message "
            "lets the model continue the last message, add_generation_prompt opens a new assistant message; "
            "set add_generation_prompt=False to continue"
        )


def render_chat(
    conversation: list[dict[str, Any]],
    template: str,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """One conversation -> the prompt text, as HF's apply_chat_template(..., tokenize=False).

    continue_final_message (HF's): the text ends where the final message's content ends, with nothing the
    template closes it with (an end-of-turn token), so the model continues that message."""
    check_chat_flags(add_generation_prompt, continue_final_message)
    variables = {**(tokens or {}), **template_kwargs}  # caller's kwargs override special tokens, as in HF
    try:
        text = compile_template(template).render(
            messages=conversation, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # the template's own code failed
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from None
    return _cut_after_final_message(text, conversation[-1].get("content")) if continue_final_message else text


def _cut_after_final_message(text: str, final: Any) -> str:
    """HF's cut: at the last place the final message's stripped content appears, keeping its trailing
    whitespace where the template kept it."""
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError(
            f"continue_final_message: the final message has no text to continue (content={final!r})"
        )
    if final.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the chat after applying the chat "
            "template (the template changes it); check the template and the final message"
        )
    at = text.rindex(final.strip())
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]
