"""Triton kernels of the KV cache (slot mapping, block-table delta, cache write, paged attention) and
their torch references. The argument rules every kernel dispatcher shares live here, once; this module
imports no torch, so a config check can name the backends without loading it."""

from __future__ import annotations

BACKENDS = ("torch", "triton")  # "torch": the plain-torch references; "triton": the kernels


def require(cond: bool, msg: str) -> None:
    """A kernel argument rule: ValueError with `msg` when it does not hold."""
    if not cond:
        raise ValueError(msg)


def check_backend(backend: str, name: str = "backend") -> None:
    require(backend in BACKENDS, f"{name}={backend!r}: must be one of {list(BACKENDS)}")
