"""The embedded Ray (no address given) listens on the loopback address only; a cluster given by address
is joined as it is."""

import ipaddress
import os

import pytest
import ray

from cluster.config import EngineConfig
from cluster.replicas import placement
from cluster.replicas.placement import connect, start_local_ray


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _listening_sockets() -> list[tuple[str, str, int]]:
    import psutil  # vendored by ray; importable once ray is imported

    found = []
    for proc in psutil.Process().children(recursive=True):  # every Ray process this test started
        try:
            name = proc.name()
            found += [
                (name, c.laddr.ip, c.laddr.port)
                for c in proc.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@ray.remote
class _Probe:
    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


def test_embedded_ray_listens_on_loopback_only():
    assert not ray.is_initialized()
    start_local_ray(num_cpus=2, namespace="kvray-test-loopback", include_dashboard=True)
    try:
        probe = _Probe.remote()  # a core worker with its own gRPC server
        assert ray.get(probe.node_ip.remote()) == "127.0.0.1"
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        sockets = _listening_sockets()
        assert len(sockets) >= 5, sockets  # GCS, raylet, object manager, agents, the worker
        exposed = [s for s in sockets if not _is_loopback(s[1])]
        assert exposed == [], f"listening beyond loopback: {exposed}"
    finally:
        ray.shutdown()
    # the switch that keeps the node address local is put back for later connections
    from ray._private import ray_constants

    assert ray_constants.ENABLE_RAY_CLUSTER is True
    assert placement.LOCAL_ONLY_ENV not in os.environ


def test_a_cluster_by_address_is_joined_as_it_is(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    config = EngineConfig().replace(address="10.1.2.3:6379")
    assert connect(config) is False
    assert calls == [{"address": "10.1.2.3:6379", "namespace": "kvray", "log_to_driver": True}]


@pytest.mark.parametrize(
    "ip,loopback",
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.0.2.2", False),
    ],
)
def test_loopback_detection(ip, loopback):
    assert _is_loopback(ip) is loopback
