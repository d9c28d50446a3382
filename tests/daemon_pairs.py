"""Two real daemons on loopback with their pools attached, shared by the transfer tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pool_checks import fill_random

from kvxfer.certs import DevCa
from kvxfer.client import AttachedPool, KvxferClient
from kvxfer.client.spawn import LocalDaemon

#: The prefill and decode daemons, a client of each, and the pool each attached.
AttachedPair = tuple[LocalDaemon, LocalDaemon, KvxferClient, KvxferClient, AttachedPool,
                     AttachedPool]


@contextmanager
def attached_pair(root: Path, ca: DevCa, pool: str, extra_args: list[str],
                  seed: int) -> Iterator[AttachedPair]:
    """A prefill and a decode daemon with pool ``pool`` (named "kv") and ``extra_args``,
    over mutual TLS with certificates from ``ca``, each attached by a client; the
    prefill daemon's pool holds random bytes from ``seed``. Everything stops on exit."""
    ca.issue("prefill"), ca.issue("decode")
    with LocalDaemon("prefill", [pool], workdir=str(root / "p"), extra_args=extra_args,
                     tls=ca.out) as pre, \
            LocalDaemon("decode", [pool], workdir=str(root / "d"), extra_args=extra_args,
                        tls=ca.out) as dec, \
            KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, seed)
        yield pre, dec, p, d, src, dst
