"""Incremental detokenization with prefix/read offsets (the algorithm of HF TGI and vLLM).

Decoding one token at a time is wrong for most tokenizers: a multi-byte character may span several
byte-level tokens, and SentencePiece-style decoders drop or add a leading space depending on what
precedes. So each step decodes a short window twice, `tokens[prefix:read]` and `tokens[prefix:]`, and
emits the difference once it is longer and does not end in U+FFFD (the replacement character of an
unfinished UTF-8 sequence); otherwise it waits for the next token. The window starts with the
prompt's last few tokens so that the first output token decodes as it would in the full text.

Stop strings are checked on the text built here (vLLM's rule, `check_stop_strings`).
"""

from __future__ import annotations

from typing import Any

# As vLLM: this many prompt tokens give the first output tokens their decoding context.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode_next(self, token_id: int) -> str:
        """Append one token; returns the text it completes (maybe "", when a character is unfinished)."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.output_text += delta
        return delta

    def append(self, token_id: int) -> None:
        """Take a token without decoding it yet: a request with no stop string needs its text only at the
        end, and one flush() then gives the same text in one decode instead of two per token."""
        self.tokens.append(token_id)

    def flush(self) -> str:
        """At the end of the stream: the text still held back (an unfinished character decodes as U+FFFD,
        as a full decode of the same tokens would show it)."""
        if self.read_offset == len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        self.read_offset = len(self.tokens)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.output_text += delta
        return delta


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """vLLM's stop-string check: the first stop string found in the text that the newest characters could
    have completed -> (stop string, where to cut the text; -1 = keep it whole), else None.

    Only the tail the new characters touch is searched, so a stop string already passed (impossible
    once stopped) is not re-found, and the check stays O(new text) per step.
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        stop_index = output_text.find(stop_str, max(0, len(output_text) - new_char_count - len(stop_str) + 1))
        if stop_index == -1:
            continue
        if include_in_output:
            stop_index += len(stop_str)
            if stop_index >= len(output_text):
                return stop_str, -1
        return stop_str, stop_index
    return None
