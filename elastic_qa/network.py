"""Which address and interface this host reaches a peer from, and which addresses are loopback.

Used by the per-node launcher (to tell gloo, nccl and torchrun which interface and address to use) and by
the logs (to name a host by the address its peers know it by: hostnames are shared by containers and by
hosts left with a default name). Standard library only; nothing is sent on the network: a UDP socket's
connect() only asks the kernel's routing table which source address it would use.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


@dataclass(frozen=True)
class Route:
    """How this host reaches `address`: from `source`, on `interface` (None when no interface holds it)."""

    address: str
    source: str
    interface: str | None


def resolve(host: str) -> str:
    """The first address `host` resolves to on this host (an IP literal is returned as it is).

    Raises OSError when it does not resolve."""
    info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return str(info[0][4][0])


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def names_loopback(host_header: str) -> bool:
    """Whether an HTTP Host header names this machine by a loopback name or address (`localhost:8000`,
    `127.0.0.1`, `[::1]:8000`): a page elsewhere that reaches a loopback server by DNS rebinding sends its
    own name."""
    if host_header.startswith("["):
        host = host_header[1:].split("]", 1)[0]
    else:
        host = host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header
    return host.lower() == "localhost" or is_loopback(host)


def source_address(address: str) -> str:
    """The source address this host's routing table picks for packets to `address` (raises OSError when
    there is no route)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP: no packet leaves, the kernel only picks the route
        return str(probe.getsockname()[0])


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 through ioctl, IPv6 from /proc/net/if_inet6)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) == 6:
                    packed = bytes.fromhex(fields[0])
                    found.setdefault(fields[5], []).append(socket.inet_ntop(socket.AF_INET6, packed))
    except OSError:  # no IPv6 on this host
        pass
    return found


def interface_of(address: str) -> str | None:
    """The interface that holds `address`, if one on this host does."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(a.split("%")[0]) == wanted for a in addresses):
            return name
    return None


def route_to(host: str) -> Route:
    """How this host reaches `host` (a name or an address); raises OSError when it cannot."""
    address = resolve(host)
    source = source_address(address)
    return Route(address, source, interface_of(source))


def is_local_address(address: str) -> bool:
    """Whether `address` is one of this host's own addresses (only those can be bound)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def peer_facing_address(peer: str | None) -> str | None:
    """The address this host reaches `peer` from, when that is not loopback; None otherwise or on error."""
    if not peer:
        return None
    try:
        source = source_address(resolve(peer))
    except (OSError, ValueError):
        return None
    return None if is_loopback(source) else source
