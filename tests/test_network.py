"""Routes and addresses from this host's own tables (nothing is sent), and the host names logs use."""

from __future__ import annotations

import socket

import pytest

from elastic_qa.network import interface_of, is_local_address, is_loopback, peer_facing_address, route_to
from elastic_qa.observe.log import NODE_ENV, log_file_name, node_name


def test_the_route_to_loopback_leaves_from_loopback_on_the_loopback_interface() -> None:
    route = route_to("127.0.0.1")
    assert route.source == "127.0.0.1" and route.interface == interface_of("127.0.0.1") is not None
    assert is_loopback(route.source) and not is_loopback("10.0.0.1") and not is_loopback("a-name")


def test_only_this_hosts_own_addresses_are_local() -> None:
    assert is_local_address("127.0.0.1")
    assert not is_local_address("203.0.113.7")  # TEST-NET-3: documentation only, never assigned


def test_a_host_reached_over_loopback_has_no_peer_facing_address() -> None:
    assert peer_facing_address("127.0.0.1") is None
    assert peer_facing_address(None) is None
    assert peer_facing_address("no-such-host.invalid") is None


def test_logs_name_a_host_by_the_launchers_name_else_by_its_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_ENV, "trainer@10.0.0.2")
    assert node_name() == "trainer@10.0.0.2"
    monkeypatch.delenv(NODE_ENV)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # one host: nothing to tell hosts apart by
    assert node_name() == socket.gethostname()


def test_log_file_names_carry_the_host_so_hosts_sharing_a_run_dir_never_collide() -> None:
    one = log_file_name(0, "trainer@10.0.0.1/0", 7)
    other = log_file_name(0, "trainer@10.0.0.2/1", 7)
    assert one == "rank-000.trainer@10.0.0.1.pid-7.jsonl" and one != other
    assert "/" not in log_file_name(3, "a b:c/2", 7)
