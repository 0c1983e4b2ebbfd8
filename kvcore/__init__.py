"""kvcore: engine-agnostic KV-cache machinery. The top level is the vocabulary and DESIGN.md's contracts
(request.py, spec.py, messages.py, block_table.py, kv_cache_manager.py); the machinery sits below in sched/,
kv_cache/ and kernels/. Imports torch, triton and numpy, never ray.

The scheduler and the KV-cache manager are exported lazily, so that `import kvcore` stays as light as the
request types it always needs.
"""

from typing import Any

from kvcore.request import Request, RequestStatus, SamplingParams

__all__ = ["Request", "RequestStatus", "SamplingParams", "Scheduler", "KVCacheManager"]


def __getattr__(name: str) -> Any:
    if name == "Scheduler":
        from kvcore.sched.scheduler import Scheduler

        return Scheduler
    if name == "KVCacheManager":
        from kvcore.kv_cache_manager import KVCacheManager

        return KVCacheManager
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")
