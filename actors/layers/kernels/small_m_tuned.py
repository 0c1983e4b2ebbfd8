"""Where the small-M GEMM (actors/layers/kernels/small_m_gemm.py) beats torch's linear, per device.

cuBLAS is a strong default, so the Triton kernel takes a 16-bit linear layer only where it was measured
faster on that device model, for that weight shape and row count: the tables in small_m_configs/<device
name>.json, written by `python -m benchmarks.kernels.bench_small_m_gemm --write` (the same practice as
vLLM's per-device fused-MoE configs). A device without a table, a weight shape not in it, or more rows
than it covers keeps F.linear. A step of M rows takes the entry of the smallest tuned row count >= M (the
CUDA-graph batch sizes are what run; their padding rows cost little in a kernel bound by its weight read
or its launch); an entry of null is a row count where F.linear measured faster.

  {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
   "shapes": {"6144x4096": {"1": [block_n, block_k, split_k, num_stages, num_warps], "4": [...],
                            "256": [block_n, block_k, split_k, num_stages, num_warps, block_m], "512": null}}}

KVRAY_SMALL_M_GEMM=0 turns the kernel off for 16-bit weights (every layer on F.linear);
KVRAY_SMALL_M_MAX_ROWS=N keeps F.linear above N rows (unset: wherever the table says).
"""

from __future__ import annotations

import json
import os
from bisect import bisect_left
from functools import lru_cache
from pathlib import Path

import torch

from actors.layers.kernels.small_m_gemm import GemmConfig

CONFIG_DIR = Path(__file__).with_name("small_m_configs")
ENABLED = os.environ.get("KVRAY_SMALL_M_GEMM", "1") != "0"
MAX_ROWS = int(os.environ.get("KVRAY_SMALL_M_MAX_ROWS", str(1 << 30)))


def table_path(device_name: str, dtype: torch.dtype) -> Path:
    """small_m_configs/<device name, spaces as underscores>-<dtype>.json"""
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in device_name)
    return CONFIG_DIR / f"{safe}-{str(dtype).removeprefix('torch.')}.json"


def config_entry(c: GemmConfig) -> list[int]:
    """A config as the table stores it: five numbers, a sixth for a row tile of its own."""
    entry = [c.block_n, c.block_k, c.split_k, c.num_stages, c.num_warps]
    return entry + [c.block_m] if c.block_m else entry


def config_of(entry: list[int] | None) -> GemmConfig | None:
    """The table's entry as a config; None (F.linear) for null."""
    return None if entry is None else GemmConfig(*entry)


@lru_cache(maxsize=16)
def _table(device_name: str, dtype: torch.dtype) -> dict[tuple[int, int], tuple[list[int], list[GemmConfig | None]]]:
    """(N, K) -> (sorted row counts, their configs or None for F.linear) for one device model and weight
    dtype; {} if none."""
    path = table_path(device_name, dtype)
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    out: dict[tuple[int, int], tuple[list[int], list[GemmConfig | None]]] = {}
    for shape, by_m in raw["shapes"].items():
        n, k = (int(v) for v in shape.split("x"))
        ms = sorted(int(m) for m in by_m)
        out[(n, k)] = (ms, [config_of(by_m[str(m)]) for m in ms])
    return out


@lru_cache(maxsize=8)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def tuned_config(m: int, w: torch.Tensor) -> GemmConfig | None:
    """The measured-faster config for x [m, K] @ w [N, K]^T on w's device, or None (use F.linear)."""
    if not ENABLED or not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16) or not 0 < m <= MAX_ROWS:
        return None
    table = _table(_device_name(w.device.index or 0), w.dtype)
    entry = table.get((w.shape[0], w.shape[1])) if table else None
    if entry is None:
        return None
    ms, configs = entry
    i = bisect_left(ms, m)
    return configs[i] if i < len(ms) else None
