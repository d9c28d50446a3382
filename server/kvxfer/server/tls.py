"""Mutual TLS on the peer API: who may talk to this daemon, and how it dials its peers.

With ``peer_tls_cert``, ``peer_tls_key`` and ``peer_tls_ca`` set, the peer
server accepts only connections that present a client certificate signed by
that CA (a connection without one, or with one from another CA, fails in the
TLS handshake, before any service answers), and the daemon presents its own
certificate when it dials peers, checking theirs against the same CA. A peer's
identity is its certificate's common name; with ``peer_allow`` set, a peer
whose common name and DNS names are all outside it gets PERMISSION_DENIED on
every call of every service on the peer port (``interceptors.PeerAuthorization``),
and a peer this daemon dials must present such a name too (``names_presented``,
checked before the first call to it).

Without TLS the peer API is plaintext, which ``check_peer_binding`` allows on
loopback only, unless the operator says ``insecure_peer``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvxfer.errors import InvalidSpecError, PeerUnavailableError

Context = grpc.aio.ServicerContext[Any, Any]
_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _read(what: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidSpecError(f"{what}={path!r}: cannot read it: {exc.strerror}") from None


@dataclass(frozen=True)
class PeerTls:
    """This daemon's certificate and key, and the CA its peers' certificates must chain to."""

    cert: bytes
    key: bytes
    ca: bytes
    cert_path: str
    key_path: str

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> PeerTls | None:
        """The PEM files, or None when none is given; InvalidSpecError when only some are,
        or one cannot be read."""
        given = {"peer_tls_cert": cert, "peer_tls_key": key, "peer_tls_ca": ca}
        if not any(given.values()):
            return None
        missing = sorted(name for name, path in given.items() if not path)
        if missing:
            raise InvalidSpecError(f"mutual TLS needs peer_tls_cert, peer_tls_key and "
                                   f"peer_tls_ca; missing {missing}")
        tls = cls(_read("peer_tls_cert", cert), _read("peer_tls_key", key), _read("peer_tls_ca", ca),
                  cert, key)
        tls._check(cert, key, ca)
        return tls

    def _check(self, cert_path: str, key_path: str, ca_path: str) -> None:
        """Refuse files that are not what they claim, naming the file (gRPC would only say
        that the port cannot be bound, or fail every handshake)."""
        try:
            cert = x509.load_pem_x509_certificate(self.cert)
        except ValueError as exc:
            raise InvalidSpecError(f"peer_tls_cert={cert_path!r}: not a PEM certificate: {exc}") from None
        try:
            x509.load_pem_x509_certificates(self.ca)
        except ValueError as exc:
            raise InvalidSpecError(f"peer_tls_ca={ca_path!r}: not PEM certificates: {exc}") from None
        try:
            key = serialization.load_pem_private_key(self.key, password=None)
        except (ValueError, TypeError) as exc:
            raise InvalidSpecError(f"peer_tls_key={key_path!r}: not an unencrypted PEM private "
                                   f"key: {exc}") from None
        if key.public_key().public_bytes(*_SPKI) != cert.public_key().public_bytes(*_SPKI):
            raise InvalidSpecError(f"peer_tls_key={key_path!r} is not the key of "
                                   f"peer_tls_cert={cert_path!r}")

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with our certificate; require a client certificate signed by the CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Dial with our certificate; accept a server whose certificate the CA signed."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    async def names_presented(self, address: str, timeout_s: float) -> set[str]:
        """The names (common name, DNS names) on the certificate the peer at ``address``
        (host:port) presents, in a TLS handshake that checks it as the gRPC channel does:
        signed by the CA, naming the host. PeerUnavailableError if that fails or takes
        longer than ``timeout_s``. Nothing but the handshake is sent."""
        host, _, port = address.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        context = ssl.create_default_context(cadata=self.ca.decode())
        context.load_cert_chain(self.cert_path, self.key_path)
        context.set_alpn_protocols(["h2"])
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(
                host, int(port), ssl=context, server_hostname=host), timeout_s)
        except (OSError, ValueError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise PeerUnavailableError(f"peer {address!r}: the TLS handshake that checks its "
                                       f"certificate failed: {exc!r}") from None
        certificate = writer.get_extra_info("peercert") or {}
        writer.transport.abort()  # no TLS close_notify exchange: a gRPC server may never answer one
        names = {value for rdn in certificate.get("subject", ()) for key, value in rdn
                 if key == "commonName"}
        return names | {value for kind, value in certificate.get("subjectAltName", ())
                        if kind == "DNS"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (of a host:port) can only be reached from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_peer_binding(peer_address: str, tls: PeerTls | None, insecure_peer: bool) -> None:
    """Refuse a plaintext peer API on an address other machines can reach."""
    host = peer_address.rsplit(":", 1)[0]
    if tls is None and not insecure_peer and not is_loopback(host):
        raise InvalidSpecError(
            f"refusing to serve the peer API on {peer_address} without mutual TLS: give "
            "--peer-tls-cert/--peer-tls-key/--peer-tls-ca (kvxfer certs makes them), or "
            "--insecure-peer to accept anyone who can reach it")


@dataclass(frozen=True)
class Caller:
    """Who is calling the peer API: its certificate names (none without TLS) and its host."""

    names: tuple[str, ...]
    host: str

    @classmethod
    def of(cls, context: Context) -> Caller:
        """The caller of the call ``context`` belongs to."""
        peer = context.peer() or ""  # "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234", "unix:..."
        host = peer.split(":", 1)[-1].rsplit(":", 1)[0] if peer.startswith("ipv") else peer
        return cls(tuple(identities(context)), host)

    @property
    def name(self) -> str:
        """How logs, errors and limits name the caller: its certificate's common name, or
        without TLS its host (every plaintext caller from one host is the same peer)."""
        return self.names[0] if self.names else f"host {self.host}"

    def is_named(self, identity: str) -> bool:
        """Whether the caller's certificate names ``identity``."""
        return identity in self.names


def identities(context: Context) -> list[str]:
    """The caller's certificate names: its common name, then its DNS names (empty without TLS)."""
    auth = context.auth_context()
    names = [v.decode() for v in auth.get("x509_common_name", [])]
    names += [v.decode() for v in auth.get("x509_subject_alternative_name", [])]
    return names
