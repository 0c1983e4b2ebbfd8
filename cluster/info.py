"""`kvray info`: what the cluster has, and where each engine's bundles would go.

The placement is a dry run of the config's strategy on the cluster's idle capacity (totals per node,
not what other jobs hold right now). An embedded Ray is sized to this machine (its real cores and GPUs),
so a config the machine cannot hold is never reported as fitting; CPU ranks that outnumber the cores
are "oversubscribed": `kvray run` still runs them, sharing cores, and says so.
"""

from __future__ import annotations

import os
from typing import Any

from cluster.config import EngineConfig, resolved_max_model_len
from cluster.replicas.placement import bundles_for, total_request

GIB = float(1 << 30)


def shown_config(config: EngineConfig) -> dict[str, dict[str, Any]]:
    """The config as the report prints it: a serve.api_key is a secret, so only whether one is set shows."""
    shown = config.to_dict()
    if shown["serve"].get("api_key") is not None:
        shown["serve"]["api_key"] = "<set>"
    return shown


def plan(config: EngineConfig, nodes: list[dict[str, Any]]) -> tuple[list[list[str | None]], str | None]:
    """-> (per engine, the node id of each bundle or None), and why the first engine that does not fit
    does not (None when all fit)."""
    p = config.parallel
    free = {n["node_id"]: dict(n["resources"]) for n in nodes if n["alive"]}
    out: list[list[str | None]] = []
    why = None
    bundles = bundles_for(config)
    for e in range(p.data_parallel_size):
        got = _place(bundles, free, p.stage_placement_strategy)
        if got is None:
            why = why or _why_not(config, e, bundles, free)
            out.append([None] * len(bundles))
        else:
            out.append(list(got))
    return out, why


def _why_not(
    config: EngineConfig, engine: int, bundles: list[dict[str, float]], free: dict[str, dict[str, float]]
) -> str:
    p = config.parallel
    if p.pipeline_parallel_size > 1:
        if not any(_fits(bundles[0], r) for r in free.values()):
            return (
                f"engine {engine} of {p.data_parallel_size}: a pipeline stage's {p.tensor_parallel_size} "
                f"tensor-parallel rank(s) must share one node, {bundles[0]} on one node, and no node has that "
                "left; lower parallel.tensor_parallel_size or use nodes with more resources"
            )
        return (
            f"engine {engine} of {p.data_parallel_size}: {p.pipeline_parallel_size} stage(s) of {bundles[0]} "
            f"each (one node per stage at most) with {p.stage_placement_strategy} do not fit what is left"
        )
    return (
        f"engine {engine} of {p.data_parallel_size}: {len(bundles)} bundle(s) of "
        f"{bundles[0]} with {p.placement_strategy} do not fit what is left"
    )


def stage_layers(config: EngineConfig) -> tuple[list[int] | None, str | None]:
    """(decoder layers per pipeline stage, why the split is impossible) from the model's config.json;
    (None, None) when the model cannot be read here."""
    from actors.config.model_rules import pipeline_layer_partition
    from actors.config.section import ConfigError
    from actors.models.loader import read_hf_config, resolve_model_dir

    try:
        hf_config = read_hf_config(resolve_model_dir(config.model.model))
    except (OSError, ValueError):
        return None, None
    try:
        return pipeline_layer_partition(config, int(hf_config["num_hidden_layers"])), None
    except ConfigError as e:
        return None, str(e)


def _fits(bundle: dict[str, float], res: dict[str, float]) -> bool:
    return all(res.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _take(bundle: dict[str, float], res: dict[str, float]) -> None:
    for k, v in bundle.items():
        res[k] = res.get(k, 0.0) - v


def _place(bundles: list[dict[str, float]], free: dict[str, dict[str, float]], strategy: str) -> list[str] | None:
    trial = {k: dict(v) for k, v in free.items()}
    chosen: list[str] = []
    if strategy == "STRICT_PACK":
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        node = next((n for n, r in trial.items() if _fits(total, r)), None)
        if node is None:
            return None
        chosen = [node] * len(bundles)
        for b in bundles:
            _take(b, trial[node])
    else:
        for b in bundles:
            options = [n for n, r in trial.items() if _fits(b, r)]
            if strategy in ("SPREAD", "STRICT_SPREAD"):
                fresh = [n for n in options if n not in chosen]
                if strategy == "STRICT_SPREAD" or fresh:
                    options = fresh
            elif chosen and chosen[-1] in options:  # PACK: stay on the node in use while it has room
                options = [chosen[-1]]
            if not options:
                return None
            chosen.append(options[0])
            _take(b, trial[options[0]])
    free.clear()
    free.update(trial)
    return chosen


def machine_shortfall(config: EngineConfig) -> tuple[str | None, str | None]:
    """For an embedded Ray: (why the machine cannot hold the config, a note when CPU ranks would share
    cores)."""
    need = total_request(config)
    cores = os.cpu_count() or 1
    if need.get("GPU", 0.0) > 0:
        gpus = _local_gpus()
        if gpus + 1e-9 < need["GPU"]:
            return (
                f"the config asks for {need['GPU']:g} GPU(s) and this machine has {gpus}; "
                f"set RAY_ADDRESS to use a cluster, or --set parallel.device=cpu"
            ), None
    cpu_ranks = int(need.get("CPU", 0.0))
    if cpu_ranks > cores:
        return None, f"oversubscribed: {cpu_ranks} CPU rank(s) would share this machine's {cores} core(s)"
    return None, None


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA: no GPUs
        return 0


def table(report: dict[str, Any]) -> str:
    """The report as a few readable lines."""
    nodes = report["cluster"]["nodes"]
    rows = [("node", "ip", "alive", "CPUs", "GPUs", "memory GiB", "labels", "bundles")]
    where: dict[str, list[str]] = {}
    unit = "s" if report["placement"].get("stages", 1) > 1 else "r"  # bundles are stages, or ranks
    for e, placed in enumerate(report["placement"]["engines_on"]):
        for i, node in enumerate(placed):
            if node is not None:
                where.setdefault(node, []).append(f"e{e}{unit}{i}")
    for n in nodes:
        r = n["resources"]
        rows.append(
            (
                n["node_id"][:12],
                str(n["node_ip"]),
                "yes" if n["alive"] else "no",
                f"{r.get('CPU', 0):g}",
                f"{r.get('GPU', 0):g}",
                f"{r.get('memory', 0) / GIB:.1f}",
                ",".join(f"{k}={v}" for k, v in sorted(n.get("labels", {}).items())) or "-",
                " ".join(where.get(n["node_id"], [])) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    p = report["placement"]
    lines.append("")
    lines.append(
        f"config: {p['engines']} engine(s) x {p['workers_per_engine']} rank(s), bundle "
        f"{p['bundles_per_engine'][0]}, {p['strategy']}, transport {p['transport']}; "
        f"asks {p['total_request']} of {report['cluster']['cluster_resources']}"
    )
    if p.get("stages", 1) > 1:
        layers = p.get("stage_layers")
        lines.append(
            f"pipeline: {p['stages']} stage(s) of {p['ranks_per_stage']} tensor-parallel rank(s) on one node each"
            + (f", decoder layers per stage {layers}" if layers else "")
            + " (bundles e<engine>s<stage>)"
        )
    lines.extend(stage_kv_lines(report.get("kv_cache", {})))
    lines.append(f"verdict: {p['verdict']}")
    return "\n".join(lines)


def stage_kv_lines(kv: dict[str, Any]) -> list[str]:
    """With pipeline stages: the KV cache each stage holds (the layout the engine uses) and which stages
    bound the engine's block count; nothing without stages."""
    layout = kv.get(kv.get("engine_layout", "hybrid"), {})
    stages = layout.get("stages")
    if not stages:
        return []
    lines = ["KV cache per stage (one block-id space; the engine holds the fewest blocks of any stage):"]
    for st in stages:
        start, end = st["layers"]
        layers = f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
        blocks = "" if st["num_blocks"] is None else f", {st['num_blocks']} blocks"
        lines.append(
            f"  s{st['stage']}: {layers}, groups {', '.join(st['groups']) or '-'}, "
            f"{st['bytes_per_block']} B/block{blocks}"
        )
    bound = layout["block_count_bound_by"]
    lines.append(f"  block count bound by {' '.join(f's{i}' for i in bound['stages'])}: {bound['why']}")
    return lines


def info_report(config: EngineConfig, embedded: bool) -> tuple[dict[str, Any], str | None]:
    """-> (the report `kvray info` prints, why the config does not fit or None). `embedded`: no Ray
    address, so a local Ray sized to this machine is started for the look and stopped after."""
    import ray

    from cluster.replicas.placement import connect, describe_cluster, start_local_ray

    short, note = machine_shortfall(config) if embedded else (None, None)
    if embedded and not ray.is_initialized():
        # Sized to this machine, not to the config: the answer is about what the machine has.
        start_local_ray(num_cpus=os.cpu_count() or 1, namespace=config.ray.namespace, include_dashboard=False)
        started = True
    elif embedded:
        started = False  # this process talks to a Ray already (a caller's, a test's): that one is looked at
    else:
        started = connect(config)
    try:
        cluster = describe_cluster()
    finally:
        if started:
            ray.shutdown()
    engines_on, why = plan(config, cluster["nodes"])
    if embedded and note and why:
        why = None  # CPU ranks beyond the cores: the run oversubscribes them (the embedded Ray makes room)
    p = config.parallel
    layers, split_why = stage_layers(config) if p.pipeline_parallel_size > 1 else (None, None)
    why = short or split_why or why
    report = {
        "config": shown_config(config),
        "placement": {
            "engines": p.data_parallel_size,
            "workers_per_engine": p.ranks_per_engine,
            "stages": p.pipeline_parallel_size,
            "ranks_per_stage": p.tensor_parallel_size,
            "stage_layers": layers,
            "bundles_per_engine": bundles_for(config),
            "strategy": p.stage_placement_strategy,
            "collective_backend": p.collective_backend,
            "transport": config.ray.transport,
            "total_request": total_request(config),
            "fits": why is None,
            "engines_on": engines_on,
            "verdict": f"does not fit: {why}" if why else (note or "fits"),
        },
        "cluster": cluster,
        "kv_cache": kv_cache_info(config),
    }
    return report, why


def kv_cache_info(config: EngineConfig) -> dict[str, Any]:
    """One rank's KV layout and max concurrency at max_model_len (hybrid groups vs all full attention),
    from config.json alone; the pool size is known here only when fixed or on the CPU. With pipeline
    stages, each stage's layers, KV groups and bytes per block, and the stages that bound the block count."""
    from actors.models.kv_memory import kv_cache_report
    from actors.models.loader import read_hf_config, resolve_dtype, resolve_model_dir
    from kvcore.kernels.fp8 import kv_cache_torch_dtype

    try:
        hf_config = read_hf_config(resolve_model_dir(config.model.model))
        c = config.cache
        budget = int(c.cpu_kv_cache_gib * 2**30) if config.parallel.device == "cpu" else None
        dtype = resolve_dtype(config.model.dtype, hf_config)
        partition = stage_layers(config)[0] if config.parallel.pipeline_parallel_size > 1 else None
        report = kv_cache_report(
            hf_config,
            dtype,
            c.block_size,
            config.parallel.tensor_parallel_size,
            resolved_max_model_len(config, hf_config),
            config.scheduler.max_num_batched_tokens,
            c.num_gpu_blocks,
            None if c.num_gpu_blocks else budget,
            kv_cache_torch_dtype(c.kv_cache_dtype, dtype),
            partition,
        )
        report["engine_layout"] = "all_full_attention" if c.disable_hybrid_kv_cache_manager else "hybrid"
        return report
    except (OSError, ValueError) as e:
        return {"error": str(e)}
