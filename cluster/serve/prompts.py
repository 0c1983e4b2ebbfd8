"""A request's prompts -> token ids, off the event loop, within max_model_len.

The ingress's event loop carries every live stream: a 4 MB text tokenized there froze them all for
seconds. So a text with more characters than max_model_len tokens can span (the vocabulary's longest
token, in characters, times max_model_len; the batch job's rule, cluster/job/input.py) is refused
before it is tokenized, and the rest is rendered and tokenized in a worker thread (asyncio.to_thread),
which frees the loop because kvray's tokenizer releases the GIL while it encodes (cluster/client/tokenizer.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.client.chat import ChatTemplateError, as_conversations, render_chat, resolve_chat_template, special_tokens
from cluster.job.input import max_token_chars
from cluster.serve.errors import bad_request
from cluster.serve.protocol import ParsedRequest

Encoded = tuple[str | None, list[int]]  # (the text, if any; its token ids)


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_chars = max_token_chars(tokenizer) if tokenizer is not None else 0

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.max_token_chars

    async def encode(self, req: ParsedRequest) -> list[Encoded]:
        """Each prompt's (text, ids), in order; raises a 400 APIError naming the field."""
        param = "messages" if req.chat else "prompt"
        if self.tokenizer is None and (req.chat or any(p.text is not None for p in req.prompts)):
            raise bad_request("text prompts need the model's tokenizer.json on the server; send token ids", param=param)
        if req.chat:
            out = [await self._chat(req)]
        else:
            out = []
            for p in req.prompts:
                if p.token_ids is not None:
                    out.append((None, p.token_ids))
                else:
                    assert p.text is not None  # parse_request gives a text or token ids
                    self._check_chars(p.text, param)
                    out.append((p.text, await asyncio.to_thread(self.tokenizer.encode, p.text)))
        for _, ids in out:
            if not ids:
                raise bad_request(f"the {param} has no tokens: a prompt needs at least one", param=param)
            if len(ids) >= self.max_model_len:
                raise bad_request(
                    f"the prompt has {len(ids)} tokens: it must be shorter than max_model_len={self.max_model_len}",
                    param=param,
                )
        return out

    async def _chat(self, req: ParsedRequest) -> Encoded:
        text = await asyncio.to_thread(self._render, req)
        self._check_chars(text, "messages")
        # The template placed the special tokens itself (as LLM.chat tokenizes).
        return text, await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)

    def _render(self, req: ParsedRequest) -> str:
        try:
            template = resolve_chat_template(self.tokenizer.model_dir, None)
            tokens = special_tokens(self.tokenizer.model_dir) if self.tokenizer.model_dir else {}
            convs, _ = as_conversations(req.messages)
            return render_chat(
                convs[0],
                template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokens=tokens,
            )
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from None

    def _check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"the {param} text has {len(text):,} characters, more than max_model_len={self.max_model_len} "
                f"tokens can hold (a token spans at most {self.max_token_chars} characters here); refused "
                "before tokenizing",
                param=param,
            )
