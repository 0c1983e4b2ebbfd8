"""Engine configuration: frozen dataclasses, one per section, every field validated.

Each section checks its own fields on construction, so a config built in code is held to the same rules
as one read from YAML. A broken rule raises ConfigError naming the field, the value and the rule.
Rules that need the model's own config (heads, context length) live in `validate_for_model`.
Below cluster/ (the driver and the workers are built from it); reading YAML and `--set` strings is
cluster/config.py's job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from actors.config.section import (  # noqa: F401 - ConfigError and the limits are imported from here too
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_FLOAT,
    MAX_STR_CHARS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    ConfigError,
    Section,
)
from kvcore.kernels import BACKENDS as KERNEL_BACKENDS

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", *KERNEL_BACKENDS)
DEVICES = ("auto", "cpu", "cuda")
CUDAGRAPH_MODES = ("all", "decode", "none")
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DIST_BACKENDS = ("auto", "nccl", "gloo")
TRANSPORTS = ("compiled_graph", "actor_calls", "shm")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; "auto" = the model's dtype
QUANTIZATIONS = (None, "fp8")  # vLLM's online fp8 of a bf16 checkpoint (actors/layers/fp8_linear.py)
# The worker actor class an engine starts unless told otherwise (tests pass actors.worker.noop.NoopWorker).
DEFAULT_WORKER_CLS = "actors.worker.actor.Worker"


@dataclass(frozen=True)
class ModelConfig(Section):
    SECTION = "model"
    model: str = "tiny-random"  # HF directory, or "tiny-random" (built in, written on first use)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None = from the model's config (max_position_embeddings)
    seed: int = 0
    attention_backend: str = "auto"  # auto (triton on cuda, torch on cpu) | torch | triton
    enforce_eager: bool = False  # True disables CUDA graphs (cudagraph_mode none)
    cudagraph_mode: str = "all"  # all (every step replays a graph) | decode (decode steps only) | none
    # Mixed steps with more tokens than this run eagerly at their exact size: their launches are a
    # small share of their GPU time, and a bucket would pad them (vLLM's max_cudagraph_capture_size).
    # None: graphs up to scheduler.max_num_batched_tokens.
    cudagraph_max_tokens: int | None = None
    quantization: str | None = None  # "fp8": dense linear weights in e4m3 (vLLM's logprobs rule, not HF-equal)

    def _rules(self) -> None:
        self._check(self.model.strip() != "", "model", "must name an HF model directory or 'tiny-random'")
        self._check(self.quantization in QUANTIZATIONS, "quantization", "must be null or 'fp8'")
        self._check(self.dtype in DTYPES, "dtype", f"must be one of {list(DTYPES)}")
        self._check(
            self.max_model_len is None or 1 <= self.max_model_len <= MAX_TOKENS,
            "max_model_len",
            f"must be in [1, {MAX_TOKENS}] (or null for the model's own limit)",
        )
        self._check(0 <= self.seed <= INT64_MAX, "seed", f"must be in [0, {INT64_MAX}] (int64)")
        self._check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {list(ATTENTION_BACKENDS)}",
        )
        self._check(self.cudagraph_mode in CUDAGRAPH_MODES, "cudagraph_mode", f"must be one of {list(CUDAGRAPH_MODES)}")
        self._check(
            self.cudagraph_max_tokens is None or 1 <= self.cudagraph_max_tokens <= MAX_TOKENS,
            "cudagraph_max_tokens",
            f"must be in [1, {MAX_TOKENS}] (or null for every mixed step)",
        )


@dataclass(frozen=True)
class ParallelConfig(Section):
    SECTION = "parallel"
    tensor_parallel_size: int = 1
    # Stages of one engine, each of tensor_parallel_size ranks (rank = pp_rank * tp + tp_rank): the
    # decoder layers are split over them; activations cross between stages, never all-reduces.
    pipeline_parallel_size: int = 1
    # Decoder layers per stage, first stage first (vLLM's VLLM_PP_LAYER_PARTITION); null: an even split,
    # the remainder on the last stages. Checked against the model's num_hidden_layers when it is read.
    pp_layer_partition: tuple[int, ...] | None = None
    data_parallel_size: int = 1
    device: str = "auto"  # auto (cuda where the workers' nodes have GPUs, else cpu) | cpu | cuda
    placement_strategy: str = "STRICT_PACK"  # STRICT_PACK | PACK | SPREAD | STRICT_SPREAD
    gpus_per_worker: float = 1.0  # < 1 shares a GPU between ranks (then gloo, since NCCL refuses)
    distributed_backend: str = "auto"  # auto (nccl on whole GPUs, gloo otherwise) | nccl | gloo
    placement_timeout_s: float = 60.0
    step_timeout_s: float = 120.0
    # Bounds every tensor-parallel collective (gloo raises, NCCL's watchdog ends the process); null: half
    # of step_timeout_s, so a rank stuck waiting for a failed peer reports before the driver gives up.
    collective_timeout_s: float | None = None
    max_worker_restarts: int = 0
    # New driver actors a replica may get when its driver dies (the client starts them and re-sends the
    # replica's unfinished requests); 0 = a dead driver takes its replica down for good.
    max_driver_restarts: int = 3

    def _rules(self) -> None:
        self._check(1 <= self.tensor_parallel_size <= 1024, "tensor_parallel_size", "must be in [1, 1024]")
        self._check(1 <= self.pipeline_parallel_size <= 256, "pipeline_parallel_size", "must be in [1, 256]")
        self._check(
            self.pipeline_parallel_size * self.tensor_parallel_size <= 4096,
            "pipeline_parallel_size",
            "times tensor_parallel_size must be <= 4096 ranks per engine",
        )
        part = self.pp_layer_partition
        if isinstance(part, list):  # from YAML or --set: kept as a tuple, so the config stays hashable
            part = tuple(part)
            object.__setattr__(self, "pp_layer_partition", part)
        if part is not None:
            self._check(
                isinstance(part, (list, tuple))
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in part),
                "pp_layer_partition",
                "must be a list of layer counts, each an integer >= 1 (or null for an even split)",
            )
            self._check(
                len(part) == self.pipeline_parallel_size,
                "pp_layer_partition",
                f"must name one layer count per stage: {len(part)} given for "
                f"pipeline_parallel_size={self.pipeline_parallel_size}",
            )
        self._check(1 <= self.data_parallel_size <= 1024, "data_parallel_size", "must be in [1, 1024]")
        self._check(self.device in DEVICES, "device", f"must be one of {list(DEVICES)}")
        self._check(self.placement_strategy in STRATEGIES, "placement_strategy", f"must be one of {list(STRATEGIES)}")
        self._check(
            0 < self.gpus_per_worker <= 1,
            "gpus_per_worker",
            "must be in (0, 1]: one rank uses at most one GPU; a fraction shares a GPU",
        )
        self._check(
            self.distributed_backend in DIST_BACKENDS, "distributed_backend", f"must be one of {list(DIST_BACKENDS)}"
        )
        if self.distributed_backend == "nccl":
            self._check(self.device != "cpu", "distributed_backend", "nccl needs parallel.device=cuda")
            self._check(
                self.gpus_per_worker == 1.0,
                "distributed_backend",
                "nccl refuses two ranks on one GPU; use gloo (or auto) when gpus_per_worker < 1",
            )
        for name in ("placement_timeout_s", "step_timeout_s"):
            self._check(0 < getattr(self, name) <= MAX_TIMEOUT_S, name, f"must be > 0 and <= {MAX_TIMEOUT_S:g} seconds")
        self._check(
            self.collective_timeout_s is None or 0 < self.collective_timeout_s <= self.step_timeout_s,
            "collective_timeout_s",
            f"must be > 0 and <= parallel.step_timeout_s ({self.step_timeout_s:g}), or null (half of it)",
        )
        self._check(0 <= self.max_worker_restarts <= 1000, "max_worker_restarts", "must be in [0, 1000]")
        self._check(0 <= self.max_driver_restarts <= 1000, "max_driver_restarts", "must be in [0, 1000]")

    @property
    def ranks_per_engine(self) -> int:
        """pipeline_parallel_size x tensor_parallel_size: the workers (and placement bundles) of one engine."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def num_bundles(self) -> int:
        """Placement bundles of one engine: one per rank, or with pipeline stages one per stage (a bundle
        never spans nodes, so a stage's TP ranks, whose all-reduces run every layer, share a node)."""
        return self.pipeline_parallel_size if self.pipeline_parallel_size > 1 else self.tensor_parallel_size

    def bundle_of_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size if self.pipeline_parallel_size > 1 else rank

    @property
    def stage_placement_strategy(self) -> str:
        """The placement group's strategy. With pipeline stages the bundles are stages: STRICT_PACK (the
        default, "keep a TP group on one node") then packs them onto as few nodes as hold them (PACK),
        so stages spread over nodes only when they do not fit one; SPREAD and STRICT_SPREAD spread them."""
        if self.pipeline_parallel_size > 1 and self.placement_strategy == "STRICT_PACK":
            return "PACK"
        return self.placement_strategy

    @property
    def resolved_collective_timeout_s(self) -> float:
        return self.collective_timeout_s if self.collective_timeout_s is not None else self.step_timeout_s / 2

    def resolved_device(self) -> str:
        """cpu or cuda. "auto" is resolved here from this process's view (a worker asks on its own
        node); the client resolves it for the whole cluster before placing anything."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def collective_backend(self) -> str:
        """NCCL on whole GPUs; gloo on the CPU or when ranks share a GPU (NCCL refuses that)."""
        if self.distributed_backend != "auto":
            return self.distributed_backend
        return "nccl" if self.resolved_device() == "cuda" and self.gpus_per_worker == 1.0 else "gloo"


@dataclass(frozen=True)
class CacheConfig(Section):
    SECTION = "cache"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None = as many as fit in gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # of each GPU; ranks sharing one split it by gpus_per_worker
    cpu_kv_cache_gib: float = 1.0  # KV budget on the CPU device
    enable_prefix_caching: bool = True
    # Manage sliding-window layers' caches as full attention (vLLM's disable_hybrid_kv_cache_manager):
    # same outputs, fewer concurrent requests; for comparison and debugging.
    disable_hybrid_kv_cache_manager: bool = False
    # vLLM's kv_cache_dtype: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3") and "fp8_e5m2"
    # store them in one byte with scale 1.0 (twice the blocks, half the bytes each decode step reads,
    # and no longer greedy-equal to HF: outputs follow vLLM's logprobs-close rule instead).
    kv_cache_dtype: str = "auto"

    def _rules(self) -> None:
        bs = self.block_size
        self._check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}")
        self._check(1 <= bs <= 1024 and bs & (bs - 1) == 0, "block_size", "must be a power of two in [1, 1024]")
        self._check(
            self.num_gpu_blocks is None or 2 <= self.num_gpu_blocks <= INT32_MAX,
            "num_gpu_blocks",
            f"must be in [2, {INT32_MAX}] (block 0 is the null block; ids are int32), or null to size from memory",
        )
        self._check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        self._check(0 < self.cpu_kv_cache_gib <= 2**20, "cpu_kv_cache_gib", "must be > 0 and <= 1048576")


@dataclass(frozen=True)
class SchedulerConfig(Section):
    SECTION = "scheduler"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap on a prefill chunk
    # Admit waiting requests into a running batch only once this many rows are free (1 = at once), or
    # after admission_max_wait_steps steps. null = 32 / 32 on cuda (measured on the H200 with graphs for
    # every step: Llama-3.1-8B ShareGPT-like 6,564 -> 8,571 tok/s with it, benchmarks/RESULTS.md), 1 / 16
    # on the CPU.
    admission_min_batch: int | None = None
    admission_max_wait_steps: int | None = None
    async_scheduling: bool | None = None  # None = on when the device is cuda
    debug_invariants: bool = False

    def _rules(self) -> None:
        self._check(1 <= self.max_num_seqs <= MAX_TOKENS, "max_num_seqs", f"must be in [1, {MAX_TOKENS}]")
        self._check(self.max_num_batched_tokens <= INT32_MAX, "max_num_batched_tokens", f"must be <= {INT32_MAX}")
        self._check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"must be >= scheduler.max_num_seqs ({self.max_num_seqs}): every running sequence "
            f"needs at least one token per step",
        )
        self._check(
            0 <= self.long_prefill_token_threshold <= INT32_MAX,
            "long_prefill_token_threshold",
            f"must be in [0, {INT32_MAX}] (0 = no cap)",
        )
        self._check(
            self.admission_min_batch is None or 1 <= self.admission_min_batch <= self.max_num_seqs,
            "admission_min_batch",
            f"must be in [1, scheduler.max_num_seqs ({self.max_num_seqs})] or null",
        )
        self._check(
            self.admission_max_wait_steps is None or 0 <= self.admission_max_wait_steps <= INT32_MAX,
            "admission_max_wait_steps",
            f"must be in [0, {INT32_MAX}] or null",
        )


@dataclass(frozen=True)
class RayConfig(Section):
    SECTION = "ray"
    address: str | None = None  # None = RAY_ADDRESS if set, else a local Ray
    namespace: str = "kvray"
    transport: str = "shm"  # shm (fastest on the GPU host, RESULTS.md) | compiled_graph | actor_calls
    num_cpus: int | None = None  # logical CPUs of an embedded local Ray (None = enough for the config)
    include_dashboard: bool = False  # embedded local Ray only

    def _rules(self) -> None:
        self._check(
            self.address is None or self.address.strip() != "",
            "address",
            "must be a Ray address such as 'auto' or 'host:6379', or null",
        )
        self._check(self.namespace.strip() != "", "namespace", "must not be empty")
        self._check(self.transport in TRANSPORTS, "transport", f"must be one of {list(TRANSPORTS)}")
        self._check(
            self.num_cpus is None or 1 <= self.num_cpus <= 2**20, "num_cpus", "must be in [1, 1048576], or null"
        )


@dataclass(frozen=True)
class AutoscalingConfig(Section):
    """serve.autoscaling: Ray Serve autoscales the engine replicas (cluster/serve/engine_replica.py) on the
    engine requests each holds (waiting + running, all ingress replicas' together); a replica that goes
    stops taking requests, its waiting ones move, its running streams finish (or move, token-exact, after
    drain_timeout_s), then its driver and placement group go. parallel.data_parallel_size is the number
    it starts with (clamped to [min_replicas, max_replicas])."""

    SECTION = "serve.autoscaling"
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 16.0  # engine requests per replica the policy aims at
    # Ray Serve's own knobs (AutoscalingConfig), with its defaults.
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    metrics_interval_s: float = 10.0
    look_back_period_s: float = 30.0
    # How long a replica being removed lets its running streams finish before they move elsewhere.
    drain_timeout_s: float = 60.0

    def _rules(self) -> None:
        self._check(1 <= self.min_replicas <= 1024, "min_replicas", "must be in [1, 1024]")
        self._check(self.min_replicas <= self.max_replicas <= 1024, "max_replicas", "must be in [min_replicas, 1024]")
        self._check(0 < self.target_ongoing_requests <= 1e6, "target_ongoing_requests", "must be in (0, 1e6]")
        for name in ("upscale_delay_s", "downscale_delay_s", "drain_timeout_s"):
            self._check(0 <= getattr(self, name) <= 86400, name, "must be in [0, 86400] seconds")
        self._check(0 < self.metrics_interval_s <= 3600, "metrics_interval_s", "must be in (0, 3600] seconds")
        self._check(
            self.metrics_interval_s <= self.look_back_period_s <= 86400,
            "look_back_period_s",
            "must be in [metrics_interval_s, 86400] seconds",
        )


HTTP_MODES = ("proxy", "direct")


@dataclass(frozen=True)
class ServeConfig(Section):
    """`kvray serve` (cluster/serve/): what the OpenAI server admits and how it routes across replicas."""

    SECTION = "serve"
    # Requests a replica may hold beyond the scheduler.max_num_seqs it runs at once; past it on every
    # replica, new requests get 503 with Retry-After (an n-sample request counts n).
    max_queued_requests: int = 64
    retry_after_s: int = 1
    served_model_name: str | None = None  # the `model` clients name; null = model.model
    prefix_affinity: bool = True  # route requests that share prompt blocks to the same replica
    # Outstanding-request gap between the busiest and the idlest replica past which routing ignores
    # prefix affinity and takes the least-loaded replica (Ray Serve LLM's imbalanced_threshold).
    imbalance_threshold: int = 8
    # Ingress on its replica's event loop, proxy router on the proxy's (Serve: a thread each); see README.
    single_event_loop: bool = False
    # vLLM's --stream-interval: a chunk once this many new tokens are there (the first and last at once).
    stream_interval: int = 1
    # Ray Serve LLM's stream batching (its stream_batching_interval_ms, 50 ms there too): after a
    # stream's first token, at most one chunk per window; an end goes out at once. On the H200
    # (2026-12-03, Qwen3-0.6B at saturation, two hosts) 50 ms gave 0.909 / 0.922 of offline against
    # 0.830 / 0.845 with 0 (every step's tokens as a chunk), since the stream sleeps through its window.
    stream_batching_ms: float = 50.0
    # One add_requests call per replica carries every request taken while the previous call was out
    # (cluster/serve/submissions.py); false: one call per request.
    batch_submissions: bool = True
    # vLLM's --api-key: when set (or $KVRAY_API_KEY where the server starts), every /v1 route wants
    # `Authorization: Bearer <key>` (401 otherwise); /health and /metrics stay open. Kept out of repr.
    api_key: str | None = field(default=None, repr=False)
    # The largest request body accepted (413 past it); a declared Content-Length is checked before reading.
    max_request_body_bytes: int = 8 << 20
    # Ingress replicas (the HTTP side) that share the engine replicas, each with its own outbox per driver.
    ingress_replicas: int = 1
    # Who answers HTTP: "proxy", Ray Serve's proxy in front of the ingress replicas; "direct", each
    # ingress replica itself, on the server's host:port shared by the node's ingress replicas
    # (cluster/serve/direct_http.py): one process less per request and chunk, and no one proxy to saturate.
    http: str = "proxy"
    # null: parallel.data_parallel_size engine replicas, fixed. A mapping (AutoscalingConfig's fields):
    # Ray Serve scales them between min_replicas and max_replicas.
    autoscaling: AutoscalingConfig | None = None
    # Ray Serve's health_check_period_s for the engine replicas: a replica whose driver died is replaced
    # after 3 failed checks in a row, so within ~3 periods (Serve's own default period is 10 s).
    health_check_period_s: float = 5.0

    def _rules(self) -> None:
        self._check(1 <= self.ingress_replicas <= 1024, "ingress_replicas", "must be in [1, 1024]")
        self._check(self.http in HTTP_MODES, "http", f"must be one of {', '.join(map(repr, HTTP_MODES))}")
        if isinstance(self.autoscaling, Mapping):
            unknown = sorted(str(k) for k in self.autoscaling if k not in AutoscalingConfig.__dataclass_fields__)
            self._check(
                not unknown,
                "autoscaling",
                f"unknown field(s) {unknown}; known: {', '.join(AutoscalingConfig.__dataclass_fields__)}",
            )
            object.__setattr__(self, "autoscaling", AutoscalingConfig(**self.autoscaling))
        self._check(
            self.autoscaling is None or isinstance(self.autoscaling, AutoscalingConfig),
            "autoscaling",
            "must be a mapping of min_replicas, max_replicas, target_ongoing_requests, ..., or null",
        )
        self._check(0 <= self.max_queued_requests <= MAX_TOKENS, "max_queued_requests", f"must be in [0, {MAX_TOKENS}]")
        self._check(
            self.api_key is None or (self.api_key.isprintable() and self.api_key.strip() == self.api_key != ""),
            "api_key",
            "must be a non-empty printable string without surrounding spaces, or null (no key)",
        )
        self._check(
            1 << 10 <= self.max_request_body_bytes <= 1 << 30,
            "max_request_body_bytes",
            "must be in [1024, 1073741824] bytes",
        )
        self._check(1 <= self.retry_after_s <= 3600, "retry_after_s", "must be in [1, 3600] seconds")
        self._check(
            0.5 <= self.health_check_period_s <= 3600, "health_check_period_s", "must be in [0.5, 3600] seconds"
        )
        self._check(
            self.served_model_name is None or self.served_model_name.strip() != "",
            "served_model_name",
            "must be a non-empty name, or null (= model.model)",
        )
        self._check(0 <= self.imbalance_threshold <= INT32_MAX, "imbalance_threshold", f"must be in [0, {INT32_MAX}]")
        self._check(1 <= self.stream_interval <= 1024, "stream_interval", "must be in [1, 1024] tokens")
        self._check(
            isinstance(self.stream_batching_ms, (int, float)) and 0 <= self.stream_batching_ms <= 10_000,
            "stream_batching_ms",
            "must be a number of milliseconds in [0, 10000]",
        )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "ray": RayConfig,
    "serve": ServeConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"config: {name}={getattr(self, name)!r}: must be a {cls.__name__}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "EngineConfig":
        return config_from_dict(d or {})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def replace(self, **flat: Any) -> "EngineConfig":
        """A copy with fields changed by short name (`block_size=32`) or dotted name."""
        return override_fields(self, flat)

    def admission(self) -> tuple[int, int]:
        """(admission_min_batch, admission_max_wait_steps), nulls resolved for the device."""
        sc, cuda = self.scheduler, self.parallel.resolved_device() == "cuda"
        batch = (
            sc.admission_min_batch if sc.admission_min_batch is not None else (min(32, sc.max_num_seqs) if cuda else 1)
        )
        wait = sc.admission_max_wait_steps if sc.admission_max_wait_steps is not None else (32 if cuda else 16)
        return batch, wait

    @property
    def use_async_scheduling(self) -> bool:
        """scheduler.async_scheduling, where null means on for CUDA (the fastest measured setting), with
        pipeline stages too: the batch queue then also keeps the last stage from waiting on its token
        read-back before it takes the next step (actors/driver/engine_core.py)."""
        on = self.scheduler.async_scheduling
        return on if on is not None else self.parallel.resolved_device() == "cuda"


# Short names accepted by LLM(...) and from_config(**overrides): every field by its own name, which is
# vLLM's keyword for it (LLM(model=..., block_size=..., max_num_seqs=...)). Names must stay unique
# across sections, or a short name would silently pick one of them.
FIELD_PATHS: dict[str, str] = {
    f.name: f"{sec}.{f.name}" for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)
}
assert len(FIELD_PATHS) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values()), (
    "config field names must be unique across sections"
)


def config_from_dict(d: Mapping[str, Any]) -> EngineConfig:
    """Build from {section: {field: value}}; unknown sections or keys are errors naming them."""
    if not isinstance(d, Mapping):
        raise ConfigError(
            f"config: the top level must be a mapping of sections {list(SECTIONS)}, got {type(d).__name__}"
        )
    unknown = [k for k in d if k not in SECTIONS]
    if unknown:
        raise ConfigError(f"config: unknown section(s) {unknown}; known sections are {list(SECTIONS)}")
    sections = {}
    for name, cls in SECTIONS.items():
        body = d.get(name) or {}
        if not isinstance(body, Mapping):
            raise ConfigError(f"config: {name}={body!r}: a section must be a mapping of fields")
        known = [f.name for f in dataclasses.fields(cls)]
        bad = [k for k in body if k not in known]
        if bad:
            raise ConfigError(
                f"config: unknown key(s) {[f'{name}.{k}' for k in bad]}; known keys in [{name}] are {known}"
            )
        sections[name] = cls(**body)
    return EngineConfig(**sections)


def override_fields(config: EngineConfig, overrides: Mapping[str, Any]) -> EngineConfig:
    """Apply 'section.field' (or short-name) -> value overrides, or a whole section as a mapping."""
    d = config.to_dict()
    for key, value in overrides.items():
        if isinstance(value, Mapping) and key in SECTIONS:  # a whole section: parallel={...}
            for k, v in value.items():
                _set_path(d, f"{key}.{k}", v)
            continue
        _set_path(d, key if "." in key else FIELD_PATHS.get(key, key), value)
    return config_from_dict(d)


def _set_path(d: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    if len(parts) != 2 or parts[0] not in SECTIONS:
        raise ConfigError(
            f"config override {path!r}: unknown key; use section.field with a section in "
            f"{list(SECTIONS)}, or one of the field names {sorted(FIELD_PATHS)}"
        )
    section, name = parts
    if name not in d[section]:
        raise ConfigError(f"config override {path!r}: unknown key; known keys in [{section}] are {list(d[section])}")
    d[section][name] = value
