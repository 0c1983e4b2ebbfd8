"""The Ray Serve application: build it, start it, stop it.

  kvray serve --config C [--host 127.0.0.1] [--port 8000]        (cluster/cli.py -> run_server)
  serve run cluster.serve.app:build_app config=configs/local.yaml [set=serve.max_queued_requests=8,...]
  ray job submit --working-dir . -- kvray serve --config configs/gpu.yaml

The application is three Serve deployments: the engine replicas (EngineReplica: a driver and its placement
group each; parallel.data_parallel_size of them, or Ray Serve autoscaling between serve.autoscaling's
bounds), the fleet (EngineFleet, one replica: which engine replicas are up or draining), and the ingress
(OpenAIServer: serve.ingress_replicas replicas behind Serve's proxy, each routing over every engine replica;
with serve.http=direct there is no proxy: the ingress replicas share host:port themselves,
cluster/serve/direct_http.py).

`kvray serve` without an address starts the same embedded, loopback-only local Ray as `kvray run`
(cluster/replicas/placement.py), and keeps the ingress replica's internal gRPC server on loopback too
(cluster/serve/loopback.py); with RAY_ADDRESS (as under `ray job submit`) it joins that cluster. The API
key (serve.api_key, else $KVRAY_API_KEY) is read here, where the server is started, and handed to the
ingress. A port already taken is refused before Ray starts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any, Iterator

from cluster.config import DEFAULT_WORKER_CLS, EngineConfig, load_config

logger = logging.getLogger(__name__)

APP_NAME = "kvray"
INGRESS_HEADROOM = 64  # /health, /metrics and refusals beyond the engine requests the replicas hold
# serve.single_event_loop: Ray Serve's switches, read by each Serve process when it imports Serve.
REPLICA_ONE_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
PROXY_ONE_LOOP = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


FLEET_MAX_ONGOING = 10_000  # the ingresses' long polls and the engine replicas' registrations
DELIVERY_GRACE_S = 60  # a leaving engine replica: its last outputs' delivery, then its driver's shutdown


def max_engine_replicas(config: EngineConfig) -> int:
    a = config.serve.autoscaling
    return a.max_replicas if a is not None else config.parallel.data_parallel_size


def deployment_options(config: EngineConfig) -> dict[str, Any]:
    """The ingress deployment's options."""
    s, p = config.serve, config.parallel
    per_replica = config.scheduler.max_num_seqs + s.max_queued_requests
    actor: dict[str, Any] = {"num_cpus": 0}
    if s.single_event_loop:
        actor["runtime_env"] = {"env_vars": dict(REPLICA_ONE_LOOP)}
    # Serve's own limit must sit above ours, so that back-pressure is a 503 from the ingress (with
    # Retry-After) and never a silent queue in Serve's proxy.
    return {
        "name": "OpenAIServer",
        "num_replicas": s.ingress_replicas,
        "ray_actor_options": actor,
        "max_ongoing_requests": max_engine_replicas(config) * per_replica + INGRESS_HEADROOM,
        "graceful_shutdown_timeout_s": p.step_timeout_s + 30,
    }


def engine_deployment_options(config: EngineConfig) -> dict[str, Any]:
    """The engine replicas' deployment: a fixed number, or Ray Serve's autoscaling (cluster/serve/autoscaling.py).
    Its stop waits for the replica's drain (cluster/serve/engine_replica.py)."""
    from cluster.serve.autoscaling import serve_autoscaling_config
    from cluster.serve.engine_replica import DEFAULT_DRAIN_TIMEOUT_S

    a, p = config.serve.autoscaling, config.parallel
    drain_s = a.drain_timeout_s if a is not None else DEFAULT_DRAIN_TIMEOUT_S
    options: dict[str, Any] = {
        "name": "EngineReplica",
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 8,  # Serve's own calls only (the ingresses reach the drivers directly)
        "logging_config": {"enable_access_log": False},
        "graceful_shutdown_timeout_s": drain_s + 2 * p.step_timeout_s + DELIVERY_GRACE_S,
        # A dead or failed driver is seen within a few periods (3 failed checks in a row: Serve replaces it).
        "health_check_period_s": config.serve.health_check_period_s,
    }
    if a is None:
        options["num_replicas"] = p.data_parallel_size
    else:
        options["autoscaling_config"] = serve_autoscaling_config(a, p.data_parallel_size)
    return options


def fleet_deployment_options() -> dict[str, Any]:
    return {
        "name": "EngineFleet",
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": FLEET_MAX_ONGOING,
        "logging_config": {"enable_access_log": False},  # a long poll per ingress every few seconds
    }


def build(
    config: EngineConfig,
    worker_cls: str = DEFAULT_WORKER_CLS,
    loopback_only: bool = False,
    actor_resources: dict[str, float] | None = None,
    http_address: tuple[str, int] | None = None,
) -> Any:
    """The application: the engine replicas, the fleet, the ingress. loopback_only: this process started
    the (loopback-only) Ray, so each replica keeps its internal gRPC server on loopback. actor_resources:
    custom resources every Serve replica of the app asks for (a test pins them to the head node).
    http_address: the (host, port) the ingress replicas answer on themselves with serve.http=direct."""
    from ray import serve

    from cluster.serve.engine_replica import EngineReplica
    from cluster.serve.fleet import EngineFleet
    from cluster.serve.http_guard import resolve_api_key
    from cluster.serve.ingress import OpenAIServer

    def deploy(cls: Any, options: dict[str, Any]) -> Any:
        if actor_resources:
            options["ray_actor_options"] = {**options["ray_actor_options"], "resources": dict(actor_resources)}
        return serve.deployment(**options)(cls)

    direct = config.serve.http == "direct"
    if direct and http_address is None:
        raise ValueError(
            "serve.http='direct': the ingress replicas answer HTTP themselves and need the host and port; "
            "start it with `kvray serve --host H --port P` (`serve run` starts Serve's own proxy: use "
            "serve.http='proxy' there)"
        )
    # The app's tag names its drivers; bound here, it is the same for a fleet that Serve restarts.
    app_tag = uuid.uuid4().hex[:8]
    fleet = deploy(EngineFleet, fleet_deployment_options()).bind(loopback_only, config.ray.namespace, app_tag)
    engines = deploy(EngineReplica, engine_deployment_options(config)).bind(config, fleet, worker_cls, loopback_only)
    ingress = deploy(OpenAIServer, deployment_options(config))
    return ingress.bind(
        config, fleet, resolve_api_key(config.serve.api_key), loopback_only, engines, http_address if direct else None
    )


def build_app(args: dict[str, str]) -> Any:
    """The app builder for `serve run cluster.serve.app:build_app config=C [set=k=v,k=v]`."""
    unknown = sorted(set(args) - {"config", "set"})
    if unknown:
        raise ValueError(f"build_app: unknown argument(s) {unknown}; it takes config=PATH and set=k=v,k=v")
    overrides = [s for s in args.get("set", "").split(",") if s]
    return build(load_config(args.get("config"), overrides))


def start_server(
    config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, worker_cls: str = DEFAULT_WORKER_CLS
) -> bool:
    """Connect to Ray (or start the embedded local one), start Serve's proxy on host:port (serve.http=direct:
    no proxy; the ingress replicas bind it) and deploy the app; returns once host:port answers. -> whether
    this call started Ray (stop_server then stops it)."""
    from ray import serve

    from cluster.llm import check_model_here
    from cluster.replicas.placement import connect

    check_model_here(config)  # before Ray starts, as LLM(...) and kvray run do
    check_port_free(host, port)  # in a second, not after Ray and Serve's proxy retried for ~20 s
    with proxy_env(config):
        started = connect(config)
    direct = config.serve.http == "direct"
    try:
        if direct:
            serve.start(proxy_location="Disabled")
        else:
            serve.start(http_options={"host": host, "port": port})
        app = build(config, worker_cls, loopback_only=started, http_address=(host, port))
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        if direct:
            wait_listening(host, port, DIRECT_LISTEN_BOUND_S)
    except BaseException:
        stop_server(started)
        raise
    return started


DIRECT_LISTEN_BOUND_S = 60.0  # serve.http=direct: the app is ready; its ingress replicas bind right after


def wait_listening(host: str, port: int, bound_s: float) -> None:
    """Until host:port accepts a connection (serve.http=direct: an ingress replica serves it); raises
    TimeoutError naming both after bound_s."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"serve.http='direct': no ingress replica listens on {host}:{port} {bound_s:g} s after the "
                    f"app was ready ({e}); see the OpenAIServer replicas' logs"
                ) from None
            time.sleep(0.05)


class PortInUse(OSError):
    """The HTTP port is taken (or the host cannot be bound): the message names both."""


def check_port_free(host: str, port: int) -> None:
    """Bind host:port once, as Serve's proxy (uvicorn, SO_REUSEADDR) will; raises PortInUse if it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise PortInUse(f"--host {host!r}: cannot resolve it ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            why = "is already in use by another process" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e})"
            raise PortInUse(
                f"--port {port}: port {port} on {host} {why}; stop that server or choose another --port"
            ) from None


@contextlib.contextmanager
def proxy_env(config: EngineConfig) -> Iterator[None]:
    """While Ray starts here: the environment its workers inherit, Serve's proxy among them (a cluster
    joined through RAY_ADDRESS keeps its own)."""
    added = {k: v for k, v in PROXY_ONE_LOOP.items() if k not in os.environ} if config.serve.single_event_loop else {}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def stop_server(started_ray: bool) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    except Exception as e:  # noqa: BLE001 - Ray may be going down already
        logger.debug("serve.shutdown: %s", e)
    if started_ray and ray.is_initialized():
        ray.shutdown()


def run_server(config: EngineConfig, host: str, port: int) -> None:
    """`kvray serve`: serve until Ctrl-C or SIGTERM, then take everything down."""
    stop = threading.Event()
    started = start_server(config, host, port)
    # After ray.init, which installs its own SIGTERM handler (it would end the process without a shutdown).
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        name = config.serve.served_model_name or config.model.model
        print(
            f"kvray serve: {name!r} on {config.parallel.data_parallel_size} replica(s) at "
            f"http://{host}:{port}/v1 (Ctrl-C to stop)",
            flush=True,
        )
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_server(started)
        print("kvray serve: stopped", flush=True)
