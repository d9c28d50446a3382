"""A transfer's capability and prompt digest.

The capability is the secret an offer or an expect holds, minted by its daemon. An
offer's RequestPush must present it (once), and the claim of the pulled transfer on the
decode side too; an expect's claim (the Push's) must present the expect's; so must an
abort of any of them before a session claimed it. The prompt digest is what the pull's
must equal.
Compared in constant time, and every refusal for lack of it (an id not registered here, a
wrong or spent capability, no capability) is the same NOT_FOUND, so a caller learns
nothing about which transfers exist; a caller that holds it but is not the peer a transfer
names gets PERMISSION_DENIED. A capability is never logged.
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


def not_open_to_caller(transfer_id: str) -> TransferNotFoundError:
    """The one answer to anything that may not pull, claim or abort ``transfer_id``."""
    return TransferNotFoundError(f"no transfer {transfer_id!r} here is open to this caller")
