"""The rule machinery of the config sections: typed fields coerced from their annotations, generic
ranges every field is held to, and the one error type that names the field, the value and the rule.
The sections themselves (and their own range rules) are in actors/config/engine.py."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

from kvcore.request import check_text, short_repr


class ConfigError(ValueError):
    """A config field breaks a rule; the message names the field, the value and the rule."""


# Generic ranges every field is held to (int64, a bounded finite float, a bounded valid string), so a
# value no rule foresaw still gets a named error here and never an OverflowError in a worker.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_FLOAT = 1e15
MAX_STR_CHARS = 4096
MAX_TIMEOUT_S = 1e6  # about 11 days: longer than any step or placement wait, and within what
# threading and Ray accept as a timeout
MAX_TOKENS = 2**24  # kvcore.request.MAX_TOKENS_LIMIT: positions and lengths fit int32 with room


def _fail(section: str, name: str, value: Any, rule: str) -> None:
    # short_repr: a value from YAML may be huge (or an alias bomb); the message carries only its start
    raise ConfigError(f"config: {section}.{name}={short_repr(value)}: {rule}")


class Section:
    """Type checks from the annotations, then the section's own range rules (`_rules`)."""

    SECTION = ""
    # Every section is a dataclass (this base is not): declared so that dataclasses.fields takes self.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(self.SECTION, f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self._rules()

    def _rules(self) -> None:  # pragma: no cover - every section overrides
        pass

    def _check(self, cond: bool, name: str, rule: str) -> None:
        if not cond:
            _fail(self.SECTION, name, getattr(self, name), rule)


def _coerce(section: str, name: str, value: Any, hint: Any) -> Any:
    """Accept `value` for annotation `hint` (int for float, None for Optional), else fail by type."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if value is None:
        if optional:
            return None
        _fail(section, name, value, f"must be a {base.__name__}, not null")
    if base is bool:
        if not isinstance(value, bool):
            _fail(section, name, value, "must be a bool (true/false)")
    elif base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(section, name, value, "must be an integer")
        if not INT64_MIN <= value <= INT64_MAX:
            _fail(section, name, value, f"must be an integer in [{INT64_MIN}, {INT64_MAX}] (int64)")
    elif base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(section, name, value, "must be a number")
        if not -MAX_FLOAT <= value <= MAX_FLOAT:  # NaN, inf and ints too big for a float fail here
            _fail(section, name, value, f"must be finite, in [-{MAX_FLOAT:g}, {MAX_FLOAT:g}]")
        value = float(value)
    elif base is str:
        if not isinstance(value, str):
            _fail(section, name, value, "must be a string")
        err = check_text(f"config: {section}.{name}", value)
        if err is not None:
            raise ConfigError(err)
        if len(value) > MAX_STR_CHARS:
            _fail(section, name, value, f"must be at most {MAX_STR_CHARS} characters")
    return value
