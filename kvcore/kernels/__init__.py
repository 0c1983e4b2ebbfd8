"""Triton kernels of the KV cache (slot mapping, block-table delta, cache write, paged attention) and
their torch references. The argument rules every kernel dispatcher shares live here, once; this module
imports no torch, so a config check can name the backends without loading it."""

from __future__ import annotations

import os

BACKENDS = ("torch", "triton")  # "torch": the plain-torch references; "triton": the kernels


def require(cond: bool, msg: str) -> None:
    """A kernel argument rule: ValueError with `msg` when it does not hold."""
    if not cond:
        raise ValueError(msg)


def check_backend(backend: str, name: str = "backend") -> None:
    require(backend in BACKENDS, f"{name}={backend!r}: must be one of {list(BACKENDS)}")


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU tests): kernels run as Python, libdevice and inline PTX are
    unavailable, and numpy computes a bf16 tl.dot wrongly."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
