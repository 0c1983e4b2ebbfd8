"""Text <-> token ids for a model directory, with the `tokenizers` library and tokenizer.json only
(no Python tokenizer code from the checkpoint is ever run).

`Tokenizer.from_dir` raises TokenizerNotFoundError when the directory has no tokenizer.json;
callers that accept token-id prompts without a tokenizer use `load_tokenizer_if_present`, which
returns None then.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from actors.config.hf_json import read_eos_token_ids
from kvcore.request import SamplingParams

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # No BOS/EOS insertion beyond what tokenizer.json's post-processor defines; none at all without
        # add_special_tokens (a rendered chat template already holds them).
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer_if_present(model_dir: str) -> Tokenizer | None:
    try:
        return Tokenizer.from_dir(model_dir)
    except TokenizerNotFoundError:
        return None


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's update_from_tokenizer: each word as token ids, alone and after a space (a word inside a text
    usually tokenizes with its leading space); the spaced form only where it is a different sequence of
    the same length (vLLM's rule)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def with_bad_words_tokenized(sp: SamplingParams, tokenizer: Any) -> SamplingParams:
    """sp with bad_words_token_ids filled from bad_words (a copy; sp unchanged). Without a tokenizer it
    stays unfilled, and the engine refuses the request, naming bad_words."""
    if not sp.bad_words or sp.bad_words_token_ids is not None or tokenizer is None:
        return sp
    return replace(sp, bad_words_token_ids=bad_words_token_ids(tokenizer, sp.bad_words))
