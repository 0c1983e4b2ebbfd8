"""Connecting to Ray and reserving an engine's resources with a placement group.

No address -> an embedded local Ray sized for the config; an address (config.ray.address or
RAY_ADDRESS, as under `ray job submit`) -> connect to that cluster. A placement group that the cluster
cannot satisfy within `parallel.placement_timeout_s` fails with what was asked and what the cluster has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)

from actors.interrupts_held import interrupts_held
from cluster.config import EngineConfig
from cluster.replicas.bytecode import warn_if_no_bytecode

logger = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PlacementError(RuntimeError):
    """The cluster cannot host what the config asks for (within the timeout)."""


def bundles_for(config: EngineConfig) -> list[dict[str, float]]:
    """One bundle per tensor-parallel rank: a (share of a) GPU on cuda, one CPU on cpu. With pipeline
    stages one bundle per stage holding its TP ranks' resources: a bundle is never split over nodes,
    so each stage's ranks share a node (ParallelConfig.num_bundles)."""
    p = config.parallel
    per_bundle = p.ranks_per_engine // p.num_bundles
    one = {"GPU": p.gpus_per_worker * per_bundle} if p.device == "cuda" else {"CPU": 1.0 * per_bundle}
    return [dict(one) for _ in range(p.num_bundles)]


def total_request(config: EngineConfig) -> dict[str, float]:
    """What every data-parallel engine together asks of the cluster."""
    return _sum(bundles_for(config) * config.parallel.data_parallel_size)


def ray_address(config: EngineConfig) -> str | None:
    """The Ray cluster this process joins: config.ray.address, else RAY_ADDRESS (as under `ray job
    submit`); None starts an embedded local Ray."""
    return config.ray.address or os.environ.get("RAY_ADDRESS") or None


def embedded_ray(config: EngineConfig) -> bool:
    """Whether `connect` would start Ray on this machine (no address, and no Ray in this process yet)."""
    return ray_address(config) is None and not ray.is_initialized()


class RayConnectError(ConnectionError):
    """The Ray address given cannot be reached; the message names it and what to check."""


CONNECT_TIMEOUT_S = 10.0  # a GCS that does not accept a TCP connection in this long is not there


def check_reachable(config: EngineConfig, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail at once, naming the address, when nothing listens there: ray.init retries an unreachable
    address (or a stale `auto`, whose cluster is gone) for more than ten minutes before giving up."""
    address = ray_address(config)
    if address is None:
        return
    name = f"ray.address={address!r}" if config.ray.address else f"RAY_ADDRESS={address!r}"
    hint = (
        "check that the Ray cluster is up (`ray status` on its head node), that this is its GCS address "
        "(head:6379 by default; ray:// for Ray Client, port 10001) and that this machine can reach it; "
        "or unset ray.address and RAY_ADDRESS to start a local Ray"
    )
    target = address[len("ray://") :] if address.startswith("ray://") else address
    if target == "auto":
        from ray._private.services import get_ray_address_from_environment  # the last cluster started here

        try:
            target = get_ray_address_from_environment("auto", None) or ""
        except ConnectionError as e:
            raise RayConnectError(f"{name}: {e}; {hint}") from None
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise RayConnectError(f"{name}: not a host:port address; {hint}")
    where = "" if target == address else f" (resolved to {target})"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise RayConnectError(
            f"{name}{where}: nothing answers at {target} within {timeout_s:g}s ({why}); {hint}"
        ) from None


def connect(config: EngineConfig) -> bool:
    """Make sure this process talks to Ray. Returns True when this call started a local Ray."""
    warn_if_no_bytecode()
    if ray.is_initialized():
        return False
    address = ray_address(config)
    if address:
        check_reachable(config)
        # A loopback address is a kvray-style local Ray: this process must take 127.0.0.1 for its own
        # node address too, or it looks for a raylet on the machine's outward IP and never finds one.
        with (
            interrupts_held_until_ray_is_up(),
            loopback_node_ip() if _is_loopback(address) else contextlib.nullcontext(),
        ):
            ray.init(address=address, namespace=config.ray.namespace, log_to_driver=True)
        return False
    need = int(total_request(config).get("CPU", 0))
    existing = running_local_cluster()
    if existing:
        # Joining it would need it to have kvray's resources, and would disturb its other users.
        logger.warning(
            "a Ray cluster is already running on this machine (%s): starting a private local Ray "
            "for this job (RAY_ADDRESS=%s would use that cluster instead)",
            existing,
            existing,
        )
    start_local_ray(
        num_cpus=config.ray.num_cpus or max(os.cpu_count() or 1, need + 1),
        namespace=config.ray.namespace,
        include_dashboard=config.ray.include_dashboard,
        **prestart_setting(local_gpus() > 0),
    )
    return True


def local_gpus() -> int:
    """NVIDIA GPUs on this machine, as Ray counts them (NVML; 0 when there is no driver)."""
    try:
        from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

        return int(NvidiaGPUAcceleratorManager.get_current_node_num_accelerators())
    except Exception:  # noqa: BLE001 - no NVML, a changed private module: Ray's defaults then
        return 0


def resolve_device(config: EngineConfig) -> EngineConfig:
    """parallel.device=auto becomes cuda when the cluster has GPUs, else cpu (call after connect)."""
    if config.parallel.device != "auto":
        return config
    gpus = float(ray.cluster_resources().get("GPU", 0))
    return config.replace(device="cuda" if gpus > 0 else "cpu")


PRESTART_ENV = "RAY_prestart_worker_first_driver"


def prestart_setting(has_gpus: bool) -> dict[str, Any]:
    """ray.init's extra arguments for Ray's worker prestart on the embedded local Ray.

    On a GPU machine without it: at the first driver's connect Ray starts one idle Python worker per
    CPU, and on the H200 host (16 CPUs) their boot made the engine's own processes boot in 6-9 s instead
    of ~3 (bench_startup, same tree: LLM(...) on a running Ray 16.3 s with it, 11.1 s without). That was
    measured where every process compiled torch from source (no bytecode); it is unmeasured with
    bytecode, so Ray's own variable, when set, decides. Unmeasured elsewhere (CPU machines, the tests):
    Ray's default there."""
    if not has_gpus or PRESTART_ENV in os.environ:
        return {}
    return {"_system_config": {"prestart_worker_first_driver": False}}


def start_local_ray(
    num_cpus: int, namespace: str | None = None, include_dashboard: bool = False, **kwargs: Any
) -> None:
    """An embedded Ray on this machine whose worker processes can import kvray, reachable from it only.

    Every Ray process it starts listens on the loopback address (GCS, raylet, object manager, core
    workers, dashboard and its agent, runtime-env agent, metrics): nothing that does not already run
    on this machine can reach it. A cluster started with `ray start` is never started here (connect()
    joins it as it is), so its own settings hold.
    """
    # Workers inherit this environment: make the kvray packages importable there even when this
    # process found them through sys.path rather than an installed distribution.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _REPO_ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([_REPO_ROOT, *paths])
    # address="local": a new private instance even when `ray start` left a cluster on this machine
    # (plain ray.init() would join that one, and then refuse num_cpus).
    with interrupts_held_until_ray_is_up(), loopback_node_ip(), _dynamic_agent_port():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            namespace=namespace,
            include_dashboard=include_dashboard,
            _node_ip_address=LOOPBACK,
            dashboard_host=LOOPBACK,
            **kwargs,
        )


@contextlib.contextmanager
def interrupts_held_until_ray_is_up() -> Iterator[None]:
    """Ctrl-C (SIGINT) during ray.init is held until ray.init returns, then raised as KeyboardInterrupt
    with Ray shut down again. Raised in the middle of it, the interrupt left a half-built core worker
    that crashed the process on its way out (SIGSEGV, exit 139: seen once in nine Ctrl-C during start-up,
    reproduced by interrupting ray.init). `kvray` itself ends at once while it connects to an address
    (cluster/cli.py)."""
    try:
        with interrupts_held():
            yield
    except KeyboardInterrupt:
        if ray.is_initialized():
            ray.shutdown()
        raise


LOOPBACK = "127.0.0.1"
# Ray takes a node address of 127.0.0.1 for a placeholder and replaces it with the machine's outward
# IP (services.resolve_ip_for_localhost), unless clusters are off, as they are by default on macOS and
# Windows; then every server binds the loopback address. The switch is an environment variable read
# at `import ray`, so the already-imported constant is set for the duration of ray.init as well; the
# raylet and the workers it starts inherit the variable.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_node_ip() -> Iterator[None]:
    from ray._private import ray_constants

    old_env, old_flag = os.environ.get(LOCAL_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        # Restored so that a later connect() to a real cluster reports this machine's own address.
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = old_env


@contextlib.contextmanager
def _dynamic_agent_port() -> Iterator[None]:
    """ray.init binds the dashboard agent's HTTP server to the fixed port 52365 and has no argument to
    change it. When another Ray on the machine holds that port (a second session, or the previous
    engine's agent still exiting), the agent retries for 3.4 s, and the raylet waits for it before
    the node is up: ray.init took 6.4 s instead of 3.3 on the CPU machine. Port 0 (which the agent
    supports: it reports the port it bound) never collides."""
    from ray._private import parameter

    original = parameter.RayParams

    class _Params(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("dashboard_agent_listen_port", 0)
            super().__init__(*args, **kwargs)

    setattr(parameter, "RayParams", _Params)  # noqa: B010 - mypy refuses assigning to a class name
    try:
        yield
    finally:
        setattr(parameter, "RayParams", original)  # noqa: B010


def _is_loopback(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", LOOPBACK, "::1")


def local_address() -> str:
    """The GCS address of the Ray this process started, as other processes here must dial it."""
    gcs = ray.get_runtime_context().gcs_address
    return f"{LOOPBACK}:{gcs.rsplit(':', 1)[1]}"


def running_local_cluster() -> str | None:
    """The address of a Ray cluster that `ray start` left running on this machine, else None."""
    try:
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None)
    except Exception as e:  # noqa: BLE001 - a private API: without it, just start the private Ray
        logger.debug("looking for a running Ray cluster: %s", e)
        return None


def describe_cluster() -> dict[str, Any]:
    """What the cluster has: totals, what is free now, and the nodes."""
    nodes = [
        {
            "node_id": n.get("NodeID", ""),
            "node_ip": n.get("NodeManagerAddress"),
            "alive": n.get("Alive"),
            "resources": {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:")},
            # The labels an operator gave the node (`ray start --labels`), not Ray's own ray.io/ ones.
            "labels": {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")},
        }
        for n in ray.nodes()
    ]
    return {
        "cluster_resources": _plain(ray.cluster_resources()),
        "available_resources": _plain(ray.available_resources()),
        "nodes": nodes,
    }


def _plain(res: dict[str, float]) -> dict[str, float]:
    # Placement groups show up as derived resources ("CPU_group_<id>"); they would only confuse.
    return {k: v for k, v in sorted(res.items()) if not k.startswith("node:") and "_group_" not in k}


def create_placement_group(config: EngineConfig, name: str) -> PlacementGroup:
    """Reserve one engine's bundles; fail within placement_timeout_s with a clear message."""
    p = config.parallel
    bundles = bundles_for(config)
    # Fail at once when even the whole (idle) cluster could not hold one bundle set.
    totals = ray.cluster_resources()
    for res, amount in _sum(bundles).items():
        if totals.get(res, 0.0) + 1e-9 < amount:
            raise PlacementError(_message(config, name, bundles, "the cluster does not have that many"))
    pg = placement_group(bundles, strategy=p.stage_placement_strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=p.placement_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            _message(
                config, name, bundles, f"not satisfied within parallel.placement_timeout_s={p.placement_timeout_s:g}s"
            )
        )
    return pg


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _message(config: EngineConfig, name: str, bundles: list[dict[str, float]], why: str) -> str:
    p = config.parallel
    info = describe_cluster()
    return (
        f"placement group {name!r}: asked for {len(bundles)} bundle(s) {bundles[0]} "
        f"(parallel.tensor_parallel_size={p.tensor_parallel_size}, pipeline_parallel_size="
        f"{p.pipeline_parallel_size}, device={p.device}, gpus_per_worker={p.gpus_per_worker:g}, "
        f"strategy={p.stage_placement_strategy}) for each of "
        f"{p.data_parallel_size} data-parallel engine(s): {why}. The cluster has "
        f"{info['cluster_resources']} in total, {info['available_resources']} free now, on "
        f"{sum(1 for n in info['nodes'] if n['alive'])} node(s)."
    )


def remove(pg: PlacementGroup | None) -> None:
    if pg is None:
        return
    try:
        remove_placement_group(pg)
    # A best-effort release on the way out (shutdown, or a failed start about to raise its own error):
    # already removed, or Ray going down, leaves nothing to release, and no failure here may mask the
    # caller's; it is logged, not raised.
    except Exception as e:  # noqa: BLE001
        logger.debug("remove_placement_group: %s", e)
