"""Ports for the servers a test starts and that bind later: Serve's HTTP port, a Ray head's ports.

bind(("", 0)) hands out a port from the kernel's ephemeral range (ip_local_port_range), the range every
outgoing connection on the host draws its local port from. Between that pick and the server's own bind
(seconds, while Ray starts and opens its connections) another process may take it, and the server fails
with EADDRINUSE: with two test suites on one host it happens. The kernel never hands out a port below
that range by itself, so a port picked at random there and bindable now can only be taken by another
deliberate pick: one chance in thousands, not a race with every connection on the host.
"""

from __future__ import annotations

import random
import socket

_SPAN = 12_000  # ports below the ephemeral range to pick from


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """`count` distinct ports below the ephemeral range, each bindable on every interface now."""
    low = ephemeral_low()
    rng = random.SystemRandom()
    picked: list[int] = []
    for _ in range(100 * count):
        port = rng.randrange(max(1024, low - _SPAN), low)
        if port in picked:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == count:
            return picked
    raise RuntimeError(f"no {count} free ports below the ephemeral range (from {low})")


def free_port() -> int:
    return free_ports(1)[0]
