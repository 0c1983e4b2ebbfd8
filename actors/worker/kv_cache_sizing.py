"""KV-cache sizing and allocation for one rank: the layers' specs, the profile run, the block count,
and the memory tensors bound to the attention layers."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from actors.config.engine import ConfigError, EngineConfig
from actors.forward_context import ForwardContext, set_forward_context
from actors.models.kv_memory import cut_groups
from actors.models.stage import StageActivations
from kvcore.kernels.fp8 import is_fp8, kv_cache_torch_dtype
from kvcore.kernels.kv_layout import kv_layout, paged_kv_view
from kvcore.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    group_layers_by_spec,
    num_blocks_for_budget,
)

if TYPE_CHECKING:
    from actors.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the KV cache is allocated in. The Triton kernels convert e4m3 in hardware, which
    GPUs before compute capability 8.9 lack (e5m2 converts on any)."""
    dtype = kv_cache_torch_dtype(kv_cache_dtype, model_dtype)
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ConfigError(
                f"cache.kv_cache_dtype={kv_cache_dtype!r}: fp8 e4m3 needs a GPU of compute capability >= 8.9 "
                f"(this one is {cap[0]}.{cap[1]}); use 'fp8_e5m2' or 'auto'"
            )
    if is_fp8(dtype):
        # As vLLM says it: a checkpoint without k/v scales stores K and V unscaled.
        logger.info("KV cache in %s with k_scale = v_scale = 1.0", dtype)
    return dtype


def kv_cache_specs(
    model: DecoderForCausalLM, block_size: int, dtype: torch.dtype, hybrid: bool = True
) -> dict[str, KVCacheSpec]:
    """hybrid=False gives sliding-window layers full-attention specs (one group, no window savings)."""
    specs: dict[str, KVCacheSpec] = {}
    for layer in model.attention_layers():
        shape = (block_size, layer.num_kv_heads, layer.head_size, dtype)  # both spec classes start with these
        specs[layer.layer_name] = (
            SlidingWindowSpec(*shape, sliding_window=layer.sliding_window)
            if layer.sliding_window and hybrid
            else FullAttentionSpec(*shape)
        )
    return specs


@torch.inference_mode()
def profile_run(
    model: DecoderForCausalLM,
    num_tokens: int,
    num_rows: int,
    max_model_len: int,
    device: torch.device,
    stage_inputs: StageActivations | None,
    sample: Callable[[torch.Tensor], object],
) -> None:
    """A forward of num_tokens tokens and logits for num_rows rows, with no KV cache, so the peak
    activation memory is what a real step can reach; `sample(logits)` runs the sampler's worst case.
    A later pipeline stage starts from `stage_inputs`; a stage before the last computes no logits."""
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    pos = torch.arange(num_tokens, dtype=torch.int64, device=device) % max(max_model_len, 1)
    with set_forward_context(ForwardContext(attn_metadata=None, layer_to_group={})):
        if stage_inputs is not None:
            hidden = model(ids, pos, stage_inputs.narrow(num_tokens))
        else:
            hidden = model(ids, pos)
    if isinstance(hidden, StageActivations):
        return
    logits = model.compute_logits(hidden[: min(num_rows, num_tokens)])
    del hidden
    sample(logits)


def determine_num_blocks(
    config: EngineConfig,
    specs: dict[str, KVCacheSpec],
    device: torch.device,
    rank: int,
    run_profile: Callable[[], None],
    groups: list[KVCacheGroupSpec] | None = None,
) -> int:
    """Blocks this rank can hold: the override, else the memory budget left after a profile run.
    `groups`: how this rank's layers sit in the engine's groups (pipeline parallelism; own_groups)."""
    if groups is None:
        groups = group_layers_by_spec(specs)
    if config.cache.num_gpu_blocks is not None:
        return int(config.cache.num_gpu_blocks)
    if device.type != "cuda":
        run_profile()
        return num_blocks_for_budget(groups, int(config.cache.cpu_kv_cache_gib * 2**30))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profile()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    share = config.parallel.gpus_per_worker
    used = torch.cuda.max_memory_allocated(device)
    if share >= 1.0:
        # Memory held by others (other processes, the CUDA context, NCCL) is outside torch's counters.
        used += max((total - free) - torch.cuda.memory_reserved(device), 0)
    # Ranks sharing the GPU size their caches at the same time: each takes its share of the budget
    # and counts only its own tensors (what the others hold is theirs; the CUDA contexts come out
    # of the 1 - gpu_memory_utilization headroom).
    budget = int(total * config.cache.gpu_memory_utilization * min(share, 1.0)) - used
    torch.cuda.empty_cache()
    logger.info(
        "rank %d: KV budget %.2f GiB (total %.2f, peak used %.2f)", rank, budget / 2**30, total / 2**30, used / 2**30
    )
    return num_blocks_for_budget(groups, budget)


def own_groups(all_specs: dict[str, KVCacheSpec], own: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """The engine's KV-cache groups (of every pipeline stage's layers), each cut to this rank's layers:
    what one block id costs this rank is a page for each of its layers in its largest cut group."""
    groups = group_layers_by_spec(all_specs)
    return [g for g in cut_groups(groups, set(own)) if g.layer_names]


def own_kv_cache_config(config: KVCacheConfig, own_layers: set[str]) -> KVCacheConfig:
    """The engine's KV-cache config with every group cut to this rank's layers: the same groups, ids
    and block count (one block-id space for every stage), the memory of this rank's layers only."""
    return KVCacheConfig(num_blocks=config.num_blocks, kv_cache_groups=cut_groups(config.kv_cache_groups, own_layers))


def allocate_kv_cache(
    model: DecoderForCausalLM, kv_cache_config: KVCacheConfig, device: torch.device
) -> list[torch.Tensor]:
    """One memory tensor per layer slot (shared by the i-th layer of every group); binds each attention
    layer's view of it, in the page layout $KVRAY_KV_LAYOUT names (kvcore/kernels/kv_layout.py). Old
    bindings go first."""
    layers = {layer.layer_name: layer for layer in model.attention_layers()}
    slots = kv_cache_config.layer_to_slot()
    missing = sorted(set(layers) ^ set(slots))
    if missing:
        raise ValueError(f"KVCacheConfig and model disagree on attention layers: {missing}")
    for layer in layers.values():
        layer.kv_cache = None
    num_blocks = kv_cache_config.num_blocks
    page_bytes = {g.kv_cache_spec.page_size_bytes for g in kv_cache_config.kv_cache_groups if g.layer_names}
    if len(page_bytes) != 1:
        raise ValueError(f"KV-cache groups must share one page size; got {sorted(page_bytes)}")
    slot_bytes = num_blocks * page_bytes.pop()
    # Zeroed so unwritten pages hold finite values even where a kernel reads and then masks them.
    kv_caches = [
        torch.zeros(slot_bytes, dtype=torch.uint8, device=device) for _ in range(kv_cache_config.num_memory_slots)
    ]
    layout = kv_layout()
    for group in kv_cache_config.kv_cache_groups:
        if not group.layer_names:
            continue  # a group of another pipeline stage's layers only
        s = group.kv_cache_spec
        for name in group.layer_names:
            memory = kv_caches[slots[name]].view(getattr(torch, s.dtype))
            layers[name].kv_cache = paged_kv_view(memory, num_blocks, s.block_size, s.num_kv_heads, s.head_size, layout)
    return kv_caches
