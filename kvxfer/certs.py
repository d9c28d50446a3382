"""Certificates for the peer API's mutual TLS: a CA and one certificate per node.

``issue_certs`` writes what ``kvxfer certs`` makes for development and tests
(``DevCa`` issues more later): a CA (``ca.pem``, ``ca.key``) and, per node, ``NODE.pem`` and ``NODE.key`` signed
by it, valid for serving and for dialing (server and client auth), naming the
node in the subject's common name and as a DNS name, plus the hosts given as
subject alternative names (IP addresses or DNS names: what peers dial). Keys
are ECDSA P-256, written owner-only (0600). Production certificates come from
the cluster's own CA (e.g. cert-manager); kvxfer only reads PEM files.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ModuleNotFoundError as missing:
    raise ModuleNotFoundError(
        "kvxfer.certs needs cryptography: pip install 'kvxfer[certs]' (the daemon install, "
        "'kvxfer[daemon]', has it)", name=missing.name) from missing

from kvxfer.errors import InvalidSpecError

#: The hosts a development certificate names when none are given: loopback only.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class NodeFiles:
    """Where one node's certificate and key were written."""

    name: str
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write(path: Path, data: bytes, mode: int) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey,
             days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _check_node(node: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", node):
        raise InvalidSpecError(f"node name {node!r}: expected letters, digits, '.', '_' or "
                               "'-' (a DNS-like name of up to 63 characters)")


class DevCa:
    """A certificate authority kept in a directory (``ca.pem``, ``ca.key``) that issues
    node certificates beside it."""

    def __init__(self, out: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate,
                 days: int) -> None:
        self.out = out
        self._key = key
        self._cert = cert
        self._days = days

    @classmethod
    def create(cls, out: Path, name: str = "kvxfer development CA", days: int = 365) -> DevCa:
        """A new CA in ``out`` (an existing one is replaced: what it issued stops working)."""
        out.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (_builder(name, _name(name), key.public_key(), days)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write(out / "ca.key", _key_pem(key), 0o600)
        _write(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cls(out, key, cert, days)

    def issue(self, node: str, hosts: tuple[str, ...] = LOOPBACK_HOSTS) -> NodeFiles:
        """``NODE.pem`` and ``NODE.key`` for ``node``, reachable at ``hosts``."""
        _check_node(node)
        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName(node), *(_san(h) for h in hosts if h != node)]
        cert = (_builder(node, self._cert.subject, key.public_key(), self._days)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        files = NodeFiles(node, self.out / f"{node}.pem", self.out / f"{node}.key")
        _write(files.key, _key_pem(key), 0o600)
        _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return files


def issue_certs(out: Path, nodes: list[str], hosts: tuple[str, ...] = LOOPBACK_HOSTS, *,
                days: int = 365) -> list[NodeFiles]:
    """A new CA in ``out`` and a certificate per node name, for ``hosts``; what was written."""
    for node in nodes:
        _check_node(node)
    ca = DevCa.create(out, days=days)
    return [ca.issue(node, hosts) for node in nodes]
