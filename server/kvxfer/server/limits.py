"""The daemon's bounds against exhaustion, and the checks that refuse what passes them.

Per request: a deadline is 0 to ``MAX_TIMEOUT_S`` seconds, an id (transfer,
session, lease) 1 to ``MAX_ID_CHARS`` characters, a free-text field (an abort's reason, a lease's holder) at most
``MAX_TEXT_CHARS``, and a gRPC message at most ``Limits.message_bytes`` (gRPC
itself answers RESOURCE_EXHAUSTED naming both sizes). Per daemon (``Limits``):
inbound sessions per peer identity, transfers not yet ended. Retained finished transfers are bounded
by ``retain_transfers``, pages per transfer by the pool's size. A request past a
per-request bound is INVALID_ARGUMENT; one past a per-daemon bound is
RESOURCE_EXHAUSTED (``LimitExceededError``); either names the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.errors import InvalidArgumentError, LimitExceededError

#: The longest transfer, session or lease id (vLLM's request ids are under 100).
MAX_ID_CHARS = 256
#: The longest deadline a transfer or a peer call may ask for.
MAX_TIMEOUT_S = 3600.0
#: The smallest UCX message a transfer may be cut into (a peer's claim may ask for a size).
MIN_CHUNK_BYTES = 4096
#: The longest free-text field: an abort's reason, a lease's holder.
MAX_TEXT_CHARS = 1024
#: The longest prompt digest (a SHA-256 is 32 bytes; room for a longer hash).
MAX_DIGEST_BYTES = 64


@dataclass(frozen=True)
class Limits:
    """The per-daemon bounds (``kvxfer serve --max-...``)."""

    sessions_per_peer: int = 8
    active_transfers: int = 16384
    message_bytes: int = 4 << 20


def check_id(what: str, value: str) -> str:
    """``value`` if it is a usable id; InvalidArgumentError naming ``what`` otherwise."""
    if not value:
        raise InvalidArgumentError(f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgumentError(f"{what} has {len(value)} characters; the limit is {MAX_ID_CHARS}")
    return value


def check_text(what: str, value: str) -> str:
    """``value`` if it is within ``MAX_TEXT_CHARS``; InvalidArgumentError otherwise."""
    if len(value) > MAX_TEXT_CHARS:
        raise InvalidArgumentError(
            f"{what} has {len(value)} characters; the limit is {MAX_TEXT_CHARS}")
    return value


def check_digest(value: bytes) -> bytes:
    """``value`` if it is a prompt digest of at most ``MAX_DIGEST_BYTES``; InvalidArgumentError
    otherwise."""
    if len(value) > MAX_DIGEST_BYTES:
        raise InvalidArgumentError(f"prompt_digest has {len(value)} bytes; the limit is "
                                f"{MAX_DIGEST_BYTES}")
    return value


def check_seconds(what: str, value: float, *, most: float = MAX_TIMEOUT_S) -> float:
    """``value`` if it is a number of seconds from 0 to ``most``; InvalidArgumentError otherwise
    (NaN included)."""
    if not 0 <= value <= most:
        raise InvalidArgumentError(f"{what}={value}; expected 0 to {most:g} seconds")
    return value


def check_below(limit_name: str, used: int, limit: int, what: str) -> None:
    """LimitExceededError when ``used`` has reached ``limit``."""
    if used >= limit:
        raise LimitExceededError(f"{what}: {used} of {limit} ({limit_name}); try again later "
                                 f"or raise {limit_name}")
