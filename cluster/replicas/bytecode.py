"""A start-up hint: the engine's big packages installed without compiled bytecode, in a Python that will
not write it.

Every Ray process of an engine (the driver, each worker, Ray's own agents) is a new interpreter. Where
torch and Ray have no .pyc files and Python may not write them (PYTHONDONTWRITEBYTECODE=1, common in
container images, or a read-only site-packages), each of those processes compiles them from source
again. On the H200 host's image this was most of the engine's start-up: `import torch` 3.8-5.1 s
against 1.4-1.6 s with bytecode, and LLM(...) to ready 18.3 s against 9.0 s (benchmarks/RESULTS.md,
eighth session). pip compiles bytecode at install; this says so once, with the command that fixes it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

PACKAGES = ("torch", "ray", "triton")
warned = False  # the warning is given once a process (a test sets it back)


def _source_file(name: str) -> str | None:
    """A top-level package's __init__.py (or a module's .py), found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def packages_without_bytecode(names: tuple[str, ...]) -> list[str]:
    """The packages whose __init__ has no cached bytecode and that this interpreter cannot cache either:
    it would compile them from source in every new process."""
    out = []
    for name in names:
        origin = _source_file(name)
        if origin is None:
            continue
        if os.path.exists(importlib.util.cache_from_source(origin)):
            continue
        if sys.dont_write_bytecode or not os.access(os.path.dirname(origin), os.W_OK):
            out.append(name)
    return out


def warn_if_no_bytecode() -> None:
    """Log the hint once per process, when it applies."""
    global warned
    if warned:
        return
    warned = True
    missing = packages_without_bytecode(PACKAGES)
    if not missing:
        return
    dirs = " ".join(os.path.dirname(_source_file(n) or "") for n in missing)
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "their directories are read-only"
    logger.warning(
        "%s have no compiled bytecode and %s: every engine process (driver, workers, Ray's agents) compiles "
        "them from source again, seconds of start-up each. Compile them once, as pip does at install: "
        "python -m compileall -q %s",
        ", ".join(missing),
        why,
        dirs,
    )
