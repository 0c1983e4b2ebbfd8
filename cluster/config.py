"""Engine configuration: YAML -> frozen dataclasses, one per section.

SKELETON (fields are the contract the actors read). Loading from YAML, overrides and validation are
added by the [ray] work in this same file.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    model: str = "tiny-random"        # HF directory, or "tiny-random" (built in, written on first use)
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None = from the model's config (max_position_embeddings)
    seed: int = 0
    attention_backend: str = "auto"   # auto (triton on cuda, torch on cpu) | torch | triton
    enforce_eager: bool = False       # True disables CUDA graphs


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    device: str = "cpu"               # cpu | cuda
    placement_strategy: str = "STRICT_PACK"  # STRICT_PACK | PACK | SPREAD | STRICT_SPREAD
    gpus_per_worker: float = 1.0      # < 1 shares a GPU between ranks (then gloo, since NCCL refuses)
    distributed_backend: str = "auto"  # auto (nccl on whole GPUs, gloo otherwise) | nccl | gloo
    placement_timeout_s: float = 60.0
    step_timeout_s: float = 120.0
    max_worker_restarts: int = 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int | None = None     # None = as many as fit in gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0         # KV budget on the CPU device
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap on a prefill chunk
    async_scheduling: bool = False
    debug_invariants: bool = False


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None        # None = RAY_ADDRESS if set, else a local Ray
    namespace: str = "kvray"
    transport: str = "compiled_graph"  # compiled_graph | actor_calls


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
