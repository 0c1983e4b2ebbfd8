"""cluster: how a user runs kvray: config loading, Ray connection and placement, the LLM API, the CLI,
the batch job.

Exports are resolved lazily, so that importing one module of cluster/ never pulls in Ray or the
driver through this package.
"""

from typing import Any

from kvcore.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "load_config", "RequestOutput", "ConfigError"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from cluster import llm

        return getattr(llm, name)
    if name in ("EngineConfig", "load_config", "ConfigError"):
        from cluster import config

        return getattr(config, name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
