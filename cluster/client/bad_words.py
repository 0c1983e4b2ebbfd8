"""bad_words as token sequences, on the client: the engine sees token ids only (vLLM's update_from_tokenizer)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvcore.request import SamplingParams


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word as token ids, alone and after a space (inside a text a word usually tokenizes with its
    leading space); the spaced form only where it is a different sequence of the same length, vLLM's rule.
    `tokenizer.encode(text, add_special_tokens=False)` is all it needs."""
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
