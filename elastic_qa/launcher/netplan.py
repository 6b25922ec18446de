"""What one host of a multi-node job tells torchrun, gloo and nccl about the network, decided and checked
before anything starts.

torch's defaults decide by hostname resolution: the agent whose own name resolves to the endpoint's address
hosts the c10d store, gloo listens on the address the hostname resolves to, and the workers' MASTER_ADDR
is the hostname. Where a host's name resolves to 127.0.1.1 (the Debian and Ubuntu default) or hosts share
one name (containers), nobody hosts the store, or every collective dies with "Connection refused,
remote=[127.0.1.1]". So the plan is explicit: the store host is a flag, the interface is the one that
routes to the endpoint, and the local address is that interface's address. A plan that would put a
multi-host job on loopback is refused with the fix (NetworkError, exit 2).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

from elastic_qa.exits import UsageError
from elastic_qa.network import interface_addresses, interface_of, is_local_address, is_loopback, resolve
from elastic_qa.network import route_to as find_route

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class NetworkError(UsageError):
    """The network settings would not let the hosts reach each other: one line and the fix, exit 2."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str, default_port: int) -> Endpoint:
    """HOST, HOST:PORT or [IPv6]:PORT."""
    host, port = text, str(default_port)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--endpoint {text!r}: expected HOST:PORT (e.g. 10.0.0.1:29400)")
    return Endpoint(host, int(port))


@dataclass(frozen=True)
class NetworkPlan:
    endpoint_address: str
    local_addr: str
    interface: str
    env: dict[str, str]  # the variables to set for torchrun and its workers (those the user set are kept)
    notes: tuple[str, ...]  # what was decided and why, for the launcher's log


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def plan_network(
    endpoint: Endpoint,
    store_host: bool,
    backend: str,
    local_addr: str | None = None,
    interface: str | None = None,
    environ: dict[str, str] | None = None,
) -> NetworkPlan:
    """The addresses and interface this host uses, checked; raises NetworkError with the fix."""
    environ = dict(os.environ if environ is None else environ)
    try:
        endpoint_address = resolve(endpoint.host)
    except OSError as err:
        raise NetworkError(f"--endpoint {endpoint}: {endpoint.host} does not resolve here ({err})") from None
    notes = []
    hostname = socket.gethostname()
    try:
        own = resolve(hostname)
    except OSError:
        own = None
    if own and is_loopback(own):
        notes.append(f"this host's name {hostname} resolves to {own}: not used for anything")
    single_host = is_loopback(endpoint_address)
    if single_host and (_is_ip(endpoint.host) or endpoint.host == "localhost"):
        notes.append("loopback endpoint: every agent of this job is on this host")
    elif single_host:
        raise NetworkError(
            f"--endpoint {endpoint}: {endpoint.host} resolves to {endpoint_address} on this host, a loopback "
            "address (on Debian and Ubuntu /etc/hosts maps a host's own name to 127.0.1.1), so this host "
            "cannot tell which interface leads to the others. Pass the address the other hosts reach "
            f"{endpoint.host} by (e.g. --endpoint 10.0.0.1:{endpoint.port}), or map the name to it in "
            "/etc/hosts"
        )
    if local_addr is None:
        try:
            route = find_route(endpoint_address)
        except OSError as err:
            raise NetworkError(f"--endpoint {endpoint}: no route from this host ({err})") from None
        local_addr = route.source
    else:
        try:
            local_addr = resolve(local_addr)
        except OSError as err:
            raise NetworkError(f"--local-addr {local_addr}: does not resolve here ({err})") from None
        if not is_local_address(local_addr):
            raise NetworkError(f"--local-addr {local_addr}: not an address of this host")
    if not single_host and is_loopback(local_addr):
        raise NetworkError(
            f"--local-addr {local_addr} is a loopback address but the endpoint {endpoint} is not: the "
            "other hosts would reach this one's workers there. Pass this host's address on the network "
            "that leads to the endpoint, or leave --local-addr out (it is found from the route)"
        )
    chosen = interface or next((environ[v] for v in IFNAME_VARIABLES if environ.get(v)), None)
    interface = chosen or interface_of(local_addr)
    if interface is None:
        raise NetworkError(
            f"no interface of this host holds {local_addr}: pass --interface NAME (the one whose address "
            f"the other hosts reach), or --local-addr"
        )
    addresses = interface_addresses().get(interface.split(",")[0])
    if chosen and addresses is None:
        raise NetworkError(f"interface {interface}: no such interface with an address on this host")
    if not single_host and addresses and all(is_loopback(a) for a in addresses):
        raise NetworkError(
            f"interface {interface} (from --interface or GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME) is loopback "
            f"but the endpoint {endpoint} is not: gloo "
            "and nccl would listen where no other host can connect. Unset GLOO_SOCKET_IFNAME/"
            f"NCCL_SOCKET_IFNAME and --interface (the interface is found from the route), or name the one "
            f"that holds {local_addr}"
        )
    if backend == "c10d" and not single_host:
        here = is_local_address(endpoint_address)
        if store_host and not here:
            raise NetworkError(
                f"--store-host, but {endpoint_address} (the endpoint) is not an address of this host: the "
                "store must run where the endpoint points. Give --store-host on that host only"
            )
        if here and not store_host:
            raise NetworkError(
                f"the endpoint {endpoint} is this host's own address but --store-host is not given: no "
                "agent would host the c10d store. Add --store-host here (and on no other host)"
            )
    env = {variable: environ.get(variable) or interface for variable in IFNAME_VARIABLES}
    notes.append(f"local_addr {local_addr}, interface {interface} (routes to {endpoint_address})")
    return NetworkPlan(endpoint_address, local_addr, interface, env, tuple(notes))
