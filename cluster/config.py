"""Engine configuration as a user writes it: YAML files and `--set section.field=value` strings.

The sections themselves and their rules live in actors/config/engine.py, `validate_for_model` in
actors/config/model_rules.py (the driver and the workers are built from them); they are re-exported here,
where users import them.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import yaml

from actors.config.engine import (
    ATTENTION_BACKENDS,
    DEFAULT_WORKER_CLS,
    DEVICES,
    DIST_BACKENDS,
    DTYPES,
    FIELD_PATHS,
    SECTIONS,
    STRATEGIES,
    TRANSPORTS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RayConfig,
    SchedulerConfig,
    ServeConfig,
    config_from_dict,
    override_fields,
)
from actors.config.model_rules import resolved_max_model_len, validate_for_model
from cluster.config_yaml import MAX_BYTES, YamlLimitError, load_yaml


def parse_override(item: str) -> tuple[str, Any]:
    """'cache.block_size=32' -> ('cache.block_size', 32); the value is read as YAML (so 32, true, null)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: must look like section.field=value, e.g. cache.block_size=32")
    key, raw = item.split("=", 1)
    try:
        value = load_yaml(raw) if raw.strip() != "" else ""
    except YamlLimitError as e:
        raise ConfigError(f"--set {key.strip()!r}: the value is refused: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from None
    return key.strip(), value


def apply_overrides(config: EngineConfig, overrides: Mapping[str, Any] | Iterable[str]) -> EngineConfig:
    """Apply 'section.field' (or short-name) -> value overrides; strings 'k=v' are parsed first."""
    if not isinstance(overrides, Mapping):
        overrides = dict(parse_override(s) for s in overrides)
    return override_fields(config, overrides)


def load_config(
    path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | Iterable[str] = ()
) -> EngineConfig:
    """Read a YAML config (None = all defaults) and apply overrides."""
    data: Any = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {str(path)!r}: not found")
        try:
            with open(path, encoding="utf-8") as f:
                data = load_yaml(f.read(MAX_BYTES + 1)) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r}: not UTF-8 (byte {e.start})") from None
        except YamlLimitError as e:
            raise ConfigError(f"config file {str(path)!r}: refused: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r}: not valid YAML: {e}") from None
    try:
        config = config_from_dict(data)
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(f"{e} (in {path})") from None
    return apply_overrides(config, overrides)
