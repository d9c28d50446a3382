"""Audit lines (logger ``kvxfer.audit``): one per action that opens a session or touches a
transfer, from a peer or a worker: who, what, which transfer and session, and the outcome
(``ok``, or the status it was refused with). Never a capability."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from kvxfer.errors import KvxferError

log = logging.getLogger("kvxfer.audit")


@contextmanager
def audited(who: str, action: str, transfer_id: str, session_id: str = "") -> Iterator[None]:
    """One audit line for the action inside, naming ``who`` (``peer='name'`` or
    ``worker='address'``)."""
    subject = f"{who} {action} transfer={transfer_id[:80]!r} session={session_id[:8]}"
    try:
        yield
    except KvxferError as exc:
        log.info("%s: refused %s: %s", subject, exc.code, exc)
        raise
    except BaseException as exc:
        log.info("%s: failed %s", subject, type(exc).__name__)
        raise
    log.info("%s: ok", subject)
