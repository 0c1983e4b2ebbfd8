"""What the engine needs to know of rank 0's node before its workers start: the node's IP (where the
other ranks find rank 0's rendezvous store) and the model's config.json as that node sees it.

It runs as a Ray task in bundle 0 of the engine's placement group, so it stays free of torch: a fresh
worker process importing torch spent ~2 s of every engine start on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from actors.models.model_dir import resolve_model_dir


@dataclass
class NodeProbe:
    """What the probe on rank 0's node found."""

    node_ip: str
    hf_config: dict[str, Any] = field(default_factory=dict)
    model_dir: str = ""


def probe_node(model: str | None) -> NodeProbe:
    """Runs on rank 0's bundle: its node IP and the model's config.json."""
    import ray

    probe = NodeProbe(ray.util.get_node_ip_address())
    if model is not None:
        probe.model_dir = resolve_model_dir(model)  # resolving "tiny-random" writes it on this node
        with open(os.path.join(probe.model_dir, "config.json")) as f:
            probe.hf_config = json.load(f)
    return probe
