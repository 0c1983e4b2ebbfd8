"""Freezing the start-up heap of a dedicated engine process (a worker or driver actor).

Everything a worker built to get ready (torch, triton, the model, the graphs: about a million objects)
lives as long as the process. Left in the collector's oldest generation, it is walked again by the
first full collection, which the first requests' garbage triggers: tens of ms inside the first run.
vLLM's engine core freezes its heap after start-up for the same reason (shorter pauses of the oldest
generation's collections). Only for processes the engine owns: a user's process keeps its own collector.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect the start-up garbage, then move what survives out of the collector's view. Returns how
    many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
