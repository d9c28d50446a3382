"""Which peer addresses this daemon may dial (``--dial-allow``).

A pull names the peer to fetch from, and in vLLM that address arrives in a request's
``kv_transfer_params``: client input. So the daemon dials only addresses its operator
allows, as networks (CIDRs); the default is loopback only. A name is resolved (without
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


class DialPolicy:
    """Refuses to dial a peer outside the allowed networks, before any connection."""

    def __init__(self, allowed: Sequence[str]) -> None:
        self.networks = parse_networks(allowed)

    async def check(self, address: str) -> None:
        """Return if ``address`` (host:port, or a bare host) may be dialled; else
        DialNotAllowedError (outside the policy) or PeerUnavailableError (its name does not
        resolve in time)."""
        host, colon, port = address.rpartition(":")
        if not colon or host.endswith(":") or (":" in host and not host.startswith("[")):
            host, port = address, ""  # a bare host, IPv6 included
        host = host.removeprefix("[").removesuffix("]")
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
