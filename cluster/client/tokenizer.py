"""Text <-> token ids for a model directory, with the `tokenizers` library and tokenizer.json only
(no Python tokenizer code from the checkpoint is ever run).

The client tokenizes with `Tokenizer` (the `tokenizers` library alone: ~0.1 s to import). What
LLM.get_tokenizer() hands users is `hf_tokenizer`: transformers' own PreTrainedTokenizerFast over the same
tokenizer.json and tokenizer_config.json, the class vLLM users call (apply_chat_template, __call__,
batch_decode, ...). transformers takes ~3 s to import and loads no torch for it, so it is imported only
when a user asks for that tokenizer.

`Tokenizer.from_dir` raises TokenizerNotFoundError when the directory has no tokenizer.json;
callers that accept token-id prompts without a tokenizer use `load_tokenizer_if_present`, which
returns None then.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from actors.config.hf_json import read_eos_token_ids

TOKENIZER_FILE = "tokenizer.json"


class TokenizerNotFoundError(FileNotFoundError):
    """No tokenizer.json in the model directory: only token-id prompts can be served."""


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, eos_token_ids: list[int]) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.eos_token_id: int | None = eos_token_ids[0] if eos_token_ids else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.model_dir: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer":
        path = os.path.join(model_dir, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise TokenizerNotFoundError(
                f"{model_dir}: no {TOKENIZER_FILE}; text prompts need one (token-id prompts work without it)"
            )
        try:
            tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the Rust library raises a bare Exception subclass
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from e
        eos = read_eos_token_ids(model_dir)
        out = cls(tok, eos)
        out.model_dir = model_dir  # where the client finds the chat template and special tokens
        return out

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` underneath (its own API: offsets, batch encodes)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # No BOS/EOS insertion beyond what tokenizer.json's post-processor defines; none at all without
        # add_special_tokens (a rendered chat template already holds them).
        # encode_batch, not encode: it releases the GIL while it works (encode holds it throughout), so
        # the server's event loop runs on while a worker thread tokenizes a long prompt. Same ids.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def hf_tokenizer(model_dir: str) -> Any:
    """transformers' PreTrainedTokenizerFast of a model directory: tokenizer.json, with the special tokens,
    chat template (tokenizer_config.json or chat_template.jinja) and added tokens HF reads.

    The class is named, never resolved from the checkpoint (no AutoTokenizer, no auto_map), so no Python
    code the checkpoint ships is run; HF renders chat templates in its sandboxed jinja2."""
    path = os.path.join(model_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise TokenizerNotFoundError(f"{model_dir}: no {TOKENIZER_FILE}; cannot build its tokenizer")
    from transformers import PreTrainedTokenizerFast  # seconds to import: only for a user who asks

    return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True, tokenizer_file=path)


def load_tokenizer_if_present(model_dir: str) -> Tokenizer | None:
    try:
        return Tokenizer.from_dir(model_dir)
    except TokenizerNotFoundError:
        return None
