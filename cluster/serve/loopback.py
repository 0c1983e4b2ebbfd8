"""Keep the ingress replica's internal gRPC server on the loopback address when kvray started Ray itself.

Ray Serve (2.60) starts a gRPC server in every replica for inter-deployment calls, bound to `[::]:0`: all
interfaces, a random port, with no option to choose the host. On the embedded local Ray everything else
listens on 127.0.0.1 only (cluster/replicas/placement.py), and this port would be the one door from the
network into the ingress (it takes the same requests as the HTTP proxy). The replica looks the helper
that binds that server up in its module when it starts it, after the deployment's constructor ran; the
constructor replaces it with one that binds 127.0.0.1 instead of the wildcard. On a cluster joined by
address nothing changes (other nodes may need to reach the replica), and the routes' own checks (the
API key) guard it there. Should Ray move the helper, the server stays as Ray binds it and a warning says so.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("[::]", "0.0.0.0", "")
_HELPER = "add_port_to_grpc_server"


def loopback_address(address: str) -> str:
    """`[::]:0` -> `127.0.0.1:0`; an address with a named host stays as it is."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in _WILDCARD_HOSTS else address


def bind_internal_grpc_to_loopback() -> bool:
    """-> whether the replica's gRPC server will bind the loopback address."""
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        logger.warning("Ray Serve's replica module moved: its gRPC server binds as Ray sets it")
        return False
    original: Callable[[Any, str], int] | None = getattr(serve_replica, _HELPER, None)
    if original is None:
        logger.warning("Ray Serve's replica gRPC server: %s not found; it binds as Ray sets it", _HELPER)
        return False
    if getattr(original, "kvray_loopback", False):
        return True

    def bind_loopback(server: Any, address: str) -> int:
        return original(server, loopback_address(address))

    bind_loopback.kvray_loopback = True  # type: ignore[attr-defined]
    setattr(serve_replica, _HELPER, bind_loopback)
    return True
