"""What a call's gRPC metadata carries besides its message: the W3C trace context (how one
request's trace crosses processes), and the name a worker gives itself.

A worker's call to its daemon, and a daemon's call to its peer, carry the
caller's current OpenTelemetry context as ``traceparent`` (and ``tracestate``)
metadata; the callee continues the trace from it. With no span active nothing is
added, so a caller that does not trace pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import propagate
from opentelemetry.context import Context

#: The metadata key a worker names itself with (``KvxferClient.name``): self-declared, for
#: the daemon's audit lines (workers share a node with their daemon and are trusted).
WORKER_NAME_KEY = "kvxfer-worker"


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (empty when no span is active)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def incoming_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a call's metadata carries (an empty context when none)."""
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier)
