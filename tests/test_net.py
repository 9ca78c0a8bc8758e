"""``tandem/net.py``: the one free-port and route-address helpers every layer uses."""

from __future__ import annotations

import socket

from tandem.net import free_port, local_address


def test_free_port_can_be_bound_at_once() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises when the port is taken
    assert 0 < port < 65536


def test_local_address_is_the_route_towards_the_peer() -> None:
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("localhost") == "127.0.0.1"  # a host name is resolved first
    assert local_address("127.0.0.2") == "127.0.0.1"  # the loopback route, not the peer's own address
