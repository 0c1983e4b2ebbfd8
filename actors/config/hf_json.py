"""Reading a model directory's JSON files (config.json, generation_config.json) as untrusted data.

Every field kvray reads is checked for its type and range here, before any model is built, so a
malformed file gets an error that names the file and the field (never a bare JSONDecodeError,
TypeError or AttributeError from deep inside a layer), and no value reaches a worker that its dtypes
cannot hold. Messages show at most a short repr of a value: a file may hold anything.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from typing import Any

INT32_MAX = 2**31 - 1
MAX_JSON_BYTES = 64 * 2**20  # a config.json is a few KB; anything this size is not one

# Integer fields kvray reads: positive and within int32 (they size buffers and index int32 arrays).
POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# Integer fields whose every value HF's config classes accept: Qwen's max_window_layers may be 0 (every
# layer slides) or any int, and a Qwen sliding_window is ignored unless use_sliding_window is true. Where a
# window is applied, the model family requires it positive (actors.models.args).
INT_FIELDS = ("sliding_window", "max_window_layers")
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
BOOL_FIELDS = ("tie_word_embeddings", "use_sliding_window")
STRING_FIELDS = ("dtype", "torch_dtype", "hidden_act", "model_type")
DICT_FIELDS = ("rope_scaling", "rope_parameters")

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 6


class ModelConfigError(ValueError):
    """A model directory's JSON file breaks a rule; the message names the file and the field."""


def short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<{value.bit_length()}-bit int>"
    try:
        return _REPR.repr(value)
    except Exception:  # noqa: BLE001 - e.g. a 5,000-digit int nested in a list: repr() raises
        return f"<{type(value).__name__}>"


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in `path`; any way it is not one is a ModelConfigError naming the file."""
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise ModelConfigError(f"{path}: {size} bytes; a model's JSON config is at most {MAX_JSON_BYTES}")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path}: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (RecursionError, ValueError) as e:  # nesting too deep, an int with too many digits
        raise ModelConfigError(f"{path}: invalid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _fail(path: str, key: str, value: Any, rule: str) -> None:
    raise ModelConfigError(f"{path}: {key}={short(value)} {rule}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_token_id_field(path: str, key: str, value: Any) -> list[int]:
    """eos_token_id and the like: null, one id, or a list of ids, each in [0, int32]."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
        _fail(path, key, value, f"must be null, a token id or a list of token ids in [0, {INT32_MAX}]")
    return list(ids)


def check_hf_config(path: str, cfg: dict[str, Any]) -> None:
    """Types and ranges of every config.json field kvray reads (present ones; parse_args requires)."""
    for key in POSITIVE_INT_FIELDS:
        v = cfg.get(key)
        if v is not None and not (_is_int(v) and 1 <= v <= INT32_MAX):
            _fail(path, key, v, f"must be a positive integer <= {INT32_MAX}")
    for key in INT_FIELDS:
        v = cfg.get(key)
        if v is not None and not (_is_int(v) and -INT32_MAX <= v <= INT32_MAX):
            _fail(path, key, v, f"must be null or an integer in [-{INT32_MAX}, {INT32_MAX}]")
    for key in POSITIVE_FLOAT_FIELDS:
        if key in cfg:
            v = cfg[key]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
            if not ok:
                _fail(path, key, v, "must be a positive finite number")
    for key, kinds, what in (
        [(k, bool, "true or false") for k in BOOL_FIELDS]
        + [(k, str, "a string") for k in STRING_FIELDS]
        + [(k, dict, "an object or null") for k in DICT_FIELDS]
    ):
        v = cfg.get(key)
        if v is not None and not isinstance(v, kinds):
            _fail(path, key, v, f"must be {what}")
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        _fail(path, "architectures", archs, "must be a list of strings")
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        _fail(path, "layer_types", types, "must be a list of strings")
    check_token_id_field(path, "eos_token_id", cfg.get("eos_token_id"))


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir}: no config.json (not an HF model directory)")
    cfg = read_json_object(path)
    check_hf_config(path, cfg)
    return cfg


def read_eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids: config.json first (the model's own), then generation_config.json adds any others
    (Llama-3 instruct lists its end-of-turn token only there)."""
    eos: list[int] = []
    for file in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, file)
        if not os.path.isfile(path):
            continue
        for token_id in check_token_id_field(path, "eos_token_id", read_json_object(path).get("eos_token_id")):
            if token_id not in eos:
                eos.append(token_id)
    return eos
