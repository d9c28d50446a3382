"""Which peer addresses this daemon may dial (``--dial-allow``).

A pull names the peer to fetch from, and in vLLM that address arrives in a request's
``kv_transfer_params``: client input. So the daemon dials only addresses its operator
allows, as networks (CIDRs), and optionally only at some ports (``--dial-ports``: the
peers' port, so that a client cannot aim the daemon at another service of an allowed host);
the defaults are loopback only, any port. A name is resolved (without
blocking the event loop, within ``RESOLVE_S``) at every dial and every address it resolves
to must be allowed; nothing is sent to a refused peer. gRPC resolves the name again when
it connects: a DNS server that answers differently between the two (rebinding) is not
defended against, so name peers by address, or by names only a trusted DNS serves.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence

from kvxfer.errors import DialNotAllowedError, InvalidSpecError, PeerUnavailableError

#: The default policy: this host only.
LOOPBACK = ("127.0.0.0/8", "::1/128")
#: The longest a peer's name may take to resolve.
RESOLVE_S = 2.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
PortRange = tuple[int, int]


def parse_networks(values: Sequence[str]) -> tuple[Network, ...]:
    """The networks ``values`` name; InvalidSpecError naming the first that is not one."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise InvalidSpecError(f"dial_allow {value!r} is not a network; expected an address "
                                   "or CIDR such as 10.0.0.0/8 or 127.0.0.1") from None
    return tuple(networks)


def parse_ports(values: Sequence[str]) -> tuple[PortRange, ...]:
    """The port ranges ``values`` name (``7500`` or ``7500-7510``); InvalidSpecError naming
    the first that is not one."""
    ranges = []
    for value in values:
        low, _, high = str(value).partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            first = last = -1
        if not 1 <= first <= last <= 65535:
            raise InvalidSpecError(f"dial_ports {value!r} is not a port or a range of ports; "
                                   "expected a number such as 7500 or a range such as 7500-7510")
        ranges.append((first, last))
    return tuple(ranges)


class DialPolicy:
    """Refuses to dial a peer outside the allowed networks (or, with ``ports``, at another
    port), before any connection."""

    def __init__(self, allowed: Sequence[str], ports: Sequence[str] = ()) -> None:
        self.networks = parse_networks(allowed)
        self.ports = parse_ports(ports)

    async def check(self, address: str) -> None:
        """Return if ``address`` (host:port, or a bare host: the UCX host a handshake names,
        whose ports are not checked) may be dialled; else DialNotAllowedError (outside the
        policy) or PeerUnavailableError (its name does not
        resolve in time)."""
        host, colon, port = address.rpartition(":")
        if not colon or host.endswith(":") or (":" in host and not host.startswith("[")):
            host, port = address, ""  # a bare host, IPv6 included
        host = host.removeprefix("[").removesuffix("]")
        if port and not self.allows_port(port):
            raise DialNotAllowedError(
                f"peer {address!r} names port {port}, outside this daemon's dial_ports "
                f"({', '.join(f'{a}-{b}' if a != b else str(a) for a, b in self.ports)}); "
                "nothing was sent to it")
        found = {host} if _is_ip(host) else await self._resolve(address, host, port)
        outside = sorted(a for a in found if not self.allows(a))
        if outside:
            raise DialNotAllowedError(
                f"peer {address!r} ({', '.join(outside)}) is outside this daemon's dial_allow "
                f"({', '.join(map(str, self.networks)) or 'nothing'}); nothing was sent to it")

    @staticmethod
    async def _resolve(address: str, host: str, port: str) -> set[str]:
        """Every address ``host`` resolves to (off the event loop, within ``RESOLVE_S``)."""
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                host, port or None, type=socket.SOCK_STREAM), RESOLVE_S)
        except (OSError, UnicodeError, TimeoutError) as exc:
            raise PeerUnavailableError(f"peer {address!r} does not resolve: {exc!r}") from None
        return {str(info[4][0]) for info in infos}

    def allows_port(self, port: str) -> bool:
        """Whether ``port`` is one the policy allows (any, when it names none)."""
        if not self.ports:
            return True
        return port.isdigit() and any(low <= int(port) <= high for low, high in self.ports)

    def allows(self, ip: str) -> bool:
        """Whether the address ``ip`` lies in an allowed network."""
        parsed = ipaddress.ip_address(ip.split("%", 1)[0])
        if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
            parsed = parsed.ipv4_mapped
        return any(parsed.version == n.version and parsed in n for n in self.networks)


def _is_ip(host: str) -> bool:
    """Whether ``host`` is an address literal (checked as is: no lookup on the transfer path)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True
