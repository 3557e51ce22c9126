"""Process groups bind the interface that holds the node's Ray address, not what the host name resolves to
(tests/test_hosts.py runs it across real hosts; here the choice itself, on this machine's interfaces)."""

from __future__ import annotations

import os

import pytest

from rlhf_ray import distributed


def test_the_interface_is_the_one_holding_the_address_or_its_subnet():
    assert distributed.interface_of("127.0.0.1") == "lo"
    assert distributed.interface_of("127.0.0.2") == "lo"  # a loopback address the interface does not list
    nowhere = next(a for a in ("192.0.2.77", "198.51.100.77", "203.0.113.77") if not on_a_subnet_here(a))
    with pytest.raises(RuntimeError, match=rf"no network interface of this host holds its Ray node address "
                                           rf"{nowhere} \(interfaces: .*lo 127\.0\.0\.1"):
        distributed.interface_of(nowhere)


def on_a_subnet_here(address: str) -> bool:
    """`address` lies in the subnet of one of this host's IPv4 addresses (the documentation ranges are
    nowhere, except on a machine that uses one)."""
    import ipaddress
    import socket

    import psutil

    return any(ipaddress.ip_address(address) in ipaddress.ip_network(f"{a.address}/{a.netmask}", strict=False)
               for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET and a.netmask)


def test_gloo_is_told_the_interface_and_a_users_choice_is_kept(monkeypatch):
    import ray

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # unset for the function; monkeypatch restores the original after
    assert distributed.bind_to_node_address() == {"GLOO_SOCKET_IFNAME": "lo"}

    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert distributed.bind_to_node_address() == {} and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
