"""An offer's capability (the secret a pull, once, and an early abort must present) and
its prompt digest (what the pull's must equal).

Compared in constant time, and every refusal (an id not offered here, a wrong or spent
capability, a peer the offer does not name) is the same NOT_FOUND, so a caller learns
nothing about which transfers exist. A capability is never logged.
"""

from __future__ import annotations

import hmac

from kvxfer.errors import TransferNotFoundError


def presents(given: str, held: str) -> bool:
    """Whether ``given`` is the capability ``held`` (constant time; an empty one never is)."""
    return bool(held) and hmac.compare_digest(given.encode(), held.encode())


def same_prompt(presented: bytes, recorded: bytes) -> bool:
    """Whether a pull's prompt digest is the one its offer recorded (constant time)."""
    return hmac.compare_digest(presented, recorded)


def not_offered(transfer_id: str) -> TransferNotFoundError:
    """The one answer to anything that may not pull or abort ``transfer_id``."""
    return TransferNotFoundError(f"no transfer {transfer_id!r} is offered here to this caller")
