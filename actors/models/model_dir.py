"""Where a model's files are: the built-in "tiny-random" model or a local HF-format directory.

Torch-free at import (only the built-in model, written on first use, loads torch): the client, the
node probe and the loader all resolve a model name here.
"""

from __future__ import annotations

import os

from actors.interrupts_held import interrupts_held

TINY_RANDOM = "tiny-random"


def resolve_model_dir(name: str) -> str:
    """ "tiny-random" -> the built-in model (written on first use); otherwise an existing local
    directory. Nothing is downloaded."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model={name!r}: must be a local HF model directory or {TINY_RANDOM!r}")
    if name == TINY_RANDOM:
        # torch: only for the built-in model. A Ctrl-C raised inside torch's import aborts the process
        # (actors/interrupts_held.py): it is held until the import is done.
        with interrupts_held():
            from actors.models.tiny_random import ensure_tiny_random

        return ensure_tiny_random()
    path = os.path.abspath(os.path.expanduser(name))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model={name!r}: no such directory (kvray loads local HF-format directories, "
            f"or the built-in {TINY_RANDOM!r}; it downloads nothing)"
        )
    return path
