"""One side of one transfer, and the table of the states it may move between.

A transfer starts WAITING (registered, waiting for the other side), becomes
TRANSFERRING when its chunks are planned and its messages posted, and ends in
one final state: DONE, FAILED, ABORTED or DEADLINE_EXCEEDED. ``TRANSITIONS``
is the whole state machine: ``Transfer.advance`` refuses any move it does not
list (an InternalError: a bug, never a caller's fault), and the unit tests
drive every listed move.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.trace import Span

from kvxfer.errors import InternalError, KvxferError, TransferAbortedError, TransferDeadlineError
from kvxfer.offer_parts import OfferPart
from kvxfer.pages import Extent, PageRuns
from kvxfer.server.pools import Pool
from kvxfer.status import TransferInfo, TransferRole, TransferState
from kvxfer.transport import Batch

_ENDS = frozenset({TransferState.FAILED, TransferState.ABORTED, TransferState.DEADLINE_EXCEEDED})

#: Every state a transfer may move to from each state.
TRANSITIONS: Final[Mapping[TransferState, frozenset[TransferState]]] = {
    TransferState.WAITING: frozenset({TransferState.TRANSFERRING}) | _ENDS,
    TransferState.TRANSFERRING: frozenset({TransferState.DONE}) | _ENDS,
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.ABORTED: frozenset(),
    TransferState.DEADLINE_EXCEEDED: frozenset(),
}


def final_state(error: KvxferError | None) -> TransferState:
    """The state a transfer ends in: DONE without an error, else by the error's type."""
    if error is None:
        return TransferState.DONE
    if isinstance(error, TransferDeadlineError):
        return TransferState.DEADLINE_EXCEEDED
    if isinstance(error, TransferAbortedError):
        return TransferState.ABORTED
    return TransferState.FAILED


@dataclass(eq=False)
class Transfer:
    """One side of one transfer: what it moves, where it is, and what it holds.

    ``done`` is set once its final state is told (after its in-flight UCX requests, or
    its same-host copy (``copying``), if it failed with some); ``arrived`` also when its
    bytes have all landed (a receiver that still has to verify them).
    ``peer_identity``, when set, is the only peer (by certificate name) that may
    claim, pull, or abort it before a session has claimed it. ``capability`` is the
    secret an offer's pull (once: ``capability_spent``) and an abort before a session
    must present, and that a pull presents; ``prompt_digest`` what its KV was computed
    from (an offer's) or is expected to be (a pull's). ``skip_pages``: a pull's offer's
    first pages it does not move (the puller holds their KV); ``part``: which part of its
    offer ``offer_id`` a pull takes (``kvxfer.offer_parts``). An offer pulled in parts
    counts its ``parts`` and the ``parts_taken``, and sends each from a transfer of its own
    (``children``, whose ``parent`` it is). ``spans`` end with it;
    ``trace`` is the context its phases' spans belong to (``kvxfer.server.tracing``).
    """

    id: str
    role: TransferRole
    pool: Pool
    runs: PageRuns
    timeout_s: float
    deadline: float
    verify: bool = False
    peer: str = ""
    peer_identity: str = ""
    session_id: str = ""
    placed_session: str = ""  # a pull's ask placed it in this session; the answer is due
    lease_id: str = ""
    release_lease: bool = False
    capability: str = field(default="", repr=False)
    capability_spent: bool = False
    prompt_digest: bytes = b""
    skip_pages: int = 0
    offer_id: str = ""
    part: OfferPart = field(default_factory=OfferPart)
    parts: int = 0
    parts_taken: set[int] = field(default_factory=set)
    children: list[Transfer] = field(default_factory=list, repr=False)
    parent: Transfer | None = field(default=None, repr=False)
    state: TransferState = TransferState.WAITING
    history: list[TransferState] = field(default_factory=lambda: [TransferState.WAITING])
    created_unix: float = field(default_factory=time.time)
    registered: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    data_finished: float | None = None
    chunks: tuple[Extent, ...] = ()
    lanes: int = 0
    error: KvxferError | None = None
    verified: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[Any] | None = None
    batch: Batch | None = None
    copying: Future[int] | None = None
    timer: asyncio.TimerHandle | None = None
    spans: list[Span] = field(default_factory=list)
    trace: Context | None = None

    def advance(self, state: TransferState) -> None:
        """Move to ``state``; raises InternalError if the table does not allow it."""
        if state not in TRANSITIONS[self.state]:
            raise InternalError(f"transfer {self.id!r} cannot move from {self.state.name} to "
                                f"{state.name}")
        self.state = state
        self.history.append(state)

    def begin(self, chunks: tuple[Extent, ...], lanes: int) -> None:
        """Chunks planned, messages about to be posted: WAITING -> TRANSFERRING."""
        self.advance(TransferState.TRANSFERRING)
        self.chunks = chunks
        self.lanes = lanes
        self.started = time.monotonic()

    def end(self, error: KvxferError | None = None) -> bool:
        """Move to the final state ``error`` gives (once); False if already final. The
        registry sets ``done`` when it tells the end (``TransferRegistry.finish``)."""
        if self.state.final:
            return False
        self.advance(final_state(error))
        self.error = None if error is None else _detached(error)
        self.finished = time.monotonic()
        return True

    def failure(self, otherwise: str) -> KvxferError:
        """A new exception saying how this transfer ended: its error's type and message, or
        TransferAbortedError(``otherwise``). Raising the stored error itself would tie the
        raiser's frames to it for as long as the transfer is remembered."""
        if self.error is None:
            return TransferAbortedError(otherwise)
        return _detached(self.error)

    @property
    def log_fields(self) -> dict[str, str]:
        """What every log line about this transfer carries (JSON logs show them): its id
        and the id of the trace it is driven in (empty when no call about it carried one)."""
        context = self.spans[-1].get_span_context() if self.spans else None
        trace_id = format(context.trace_id, "032x") if context is not None and context.is_valid else ""
        return {"transfer_id": self.id, "trace_id": trace_id}

    @property
    def bytes_total(self) -> int:
        """Bytes the transfer moves (an offer pulled in parts: none; its parts do)."""
        if self.parts:
            return 0
        return self.runs.num_pages * self.pool.descriptor.page_bytes

    @property
    def bytes_done(self) -> int:
        """Bytes of this transfer whose messages completed."""
        if self.batch is not None:
            return self.batch.bytes_done
        return self.bytes_total if self.state == TransferState.DONE else 0

    def remaining(self) -> float:
        """Seconds to the deadline (0 when past it)."""
        return max(0.0, self.deadline - time.monotonic())

    def info(self) -> TransferInfo:
        """This side's status, as workers and peers see it."""
        seconds = data_seconds = 0.0
        if self.started is not None:
            seconds = (self.finished or time.monotonic()) - self.started
            if self.data_finished is not None:
                data_seconds = self.data_finished - self.started
        return TransferInfo(
            transfer_id=self.id, role=self.role, state=self.state, pool=self.pool.name,
            peer=self.peer, pages=self.runs.num_pages, bytes=self.bytes_total,
            bytes_done=self.bytes_done, extents=len(self.chunks), seconds=seconds,
            failure=self.error, verified=self.verified, created_unix=self.created_unix,
            data_seconds=data_seconds, lanes=self.lanes, timeout_s=self.timeout_s,
        )


def _detached(error: KvxferError) -> KvxferError:
    """A new exception of ``error``'s type and message, with no traceback: a traceback's
    frames would keep alive what they held (a peer's mapped pool, say) for as long as the
    transfer is remembered."""
    return type(error)(str(error))
