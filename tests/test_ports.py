"""tests/ports.py: the ports the serve and job tests hand to servers that bind them later."""

import socket

from tests.ports import ephemeral_low, free_ports


def test_ports_are_distinct_below_the_ephemeral_range_and_bindable_now():
    low = ephemeral_low()
    ports = free_ports(9)
    assert len(set(ports)) == 9
    assert all(1024 <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_the_ephemeral_range_is_read_from_the_kernel():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert ephemeral_low() == int(f.read().split()[0])
