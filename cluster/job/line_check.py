"""The rule-breaking of one job input line: its error type and the text check that both line formats
(kvray's own, cluster/job/input.py, and OpenAI's batch lines, cluster/job/openai_batch.py) apply."""

from __future__ import annotations

from typing import Any


class LineError(ValueError):
    """A rule one line breaks; the message is the line's error record."""


def check_text(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise LineError(f"{where}: {name} must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LineError(
            f"{where}: {name} is not valid Unicode (a lone surrogate U+{ord(value[e.start]):04X} "
            f"at character {e.start})"
        ) from None
    return value
