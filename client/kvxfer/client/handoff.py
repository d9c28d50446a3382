"""One transfer from a prefill daemon to a decode daemon, driven from one place.

What a disaggregated deployment does per request: in push mode the decode side
expects the pages and the prefill side pushes them; in pull mode the prefill side
offers them and the decode side pulls. The receiving (push) or offering (pull) side is
registered first: its answer holds the capability the other side's verb presents. That
verb is then sent with ``wait``, alongside a ``wait`` on the first side, so each answers
when its side is final. If either side fails, the other is aborted at once (as an
engine would) instead of running into its deadline. The demo, ``kvxfer bench`` and
the benchmarks all move pages through ``hand_off``.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal

from kvxfer.client.library import DEFAULT_DEADLINE_S, KvxferClient
from kvxfer.errors import KvxferError, TransferNotFoundError
from kvxfer.pages import PageRuns
from kvxfer.status import TransferInfo

#: Runs both sides' blocking calls (a gRPC call waits in C, without the GIL).
_SIDES = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kvxfer-hand-off")
#: How often an abort is tried again while the transfer is not registered there yet.
ABORT_RETRY_S = 0.005


@dataclass(frozen=True)
class Handoff:
    """How both sides of one transfer ended."""

    sent: TransferInfo
    received: TransferInfo
    mode: Literal["push", "pull"]

    @property
    def ok(self) -> bool:
        """True when both sides are DONE."""
        return self.sent.ok and self.received.ok

    @property
    def why(self) -> str:
        """Why it failed: the code (or state) name of the side that drives the transfer (the
        sender in push mode, the receiver in pull mode) if it failed, else the other's; ""
        when ok."""
        driver, other = (self.sent, self.received) if self.mode == "push" else (self.received, self.sent)
        for side in (driver, other):
            if not side.ok:
                return side.error_code or side.state.name
        return ""


def hand_off(prefill: KvxferClient, decode: KvxferClient, transfer_id: str, *, pool: str,
             src: PageRuns, dst: PageRuns, decode_peer: str = "", prefill_peer: str = "",
             mode: Literal["push", "pull"] = "push", verify: bool = False,
             timeout_s: float = 30.0) -> Handoff:
    """Move pages ``src`` of the prefill daemon's ``pool`` to pages ``dst`` of the decode
    daemon's, as transfer ``transfer_id``, and wait for both sides.

    Push mode needs ``decode_peer`` (the decode daemon's peer address), pull mode
    ``prefill_peer``. Errors of the calls themselves (a bad range, an unknown pool)
    raise their ``kvxfer.errors`` type once the other side was ended too; how the
    transfer ended is in the result.
    """
    sent: Future[TransferInfo]
    received: Future[TransferInfo]
    if mode == "push":  # the expect first: its answer holds the capability the push presents
        expected = decode.expect(transfer_id, pool, dst, timeout_s)
        received = _SIDES.submit(decode.wait, transfer_id, timeout_s or DEFAULT_DEADLINE_S)
        sent = _SIDES.submit(prefill.push, transfer_id, pool, src, decode_peer, timeout_s,
                             verify, capability=expected.capability, wait=True)
        driver = sent
    else:  # the offer first: its answer holds the capability the pull presents
        offered = prefill.offer(transfer_id, pool, src, timeout_s, verify)
        sent = _SIDES.submit(prefill.wait, transfer_id, timeout_s or DEFAULT_DEADLINE_S)
        received = _SIDES.submit(decode.pull, transfer_id, prefill_peer, pool, dst, timeout_s,
                                 capability=offered.capability, wait=True)
        driver = received
    daemon_of = {sent: prefill, received: decode}
    pending: set[Future[TransferInfo]] = {sent, received}
    while pending:
        ended, pending = wait(pending, return_when=FIRST_COMPLETED)
        for side in ended:
            why = _why_end_the_other(side, side is driver)
            for other in pending if why else ():
                _abort_until_answered(daemon_of[other], transfer_id, why, other)
    return Handoff(sent.result(), received.result(), mode)


def _why_end_the_other(side: Future[TransferInfo], drives: bool) -> str:
    """Why the other side must be aborted now that ``side`` answered ("" if it need not):
    a side was refused, or the side that drives the transfer failed."""
    error = side.exception()
    if error is not None:
        return f"the other side was refused: {error}"
    state = side.result()
    return f"the other side ended {state.state.name}" if drives and not state.ok else ""


def _abort_until_answered(client: KvxferClient, transfer_id: str, reason: str,
                          call: Future[TransferInfo]) -> None:
    """Abort ``transfer_id`` on ``client``'s daemon until ``call`` (that side's verb, sent
    at the same time) has answered: it may not have registered the transfer yet. Bounded
    by that call's own deadline."""
    while not call.done():
        try:
            client.abort(transfer_id, reason)
            return
        except TransferNotFoundError:
            wait([call], timeout=ABORT_RETRY_S)
        except KvxferError:
            return  # that daemon cannot be reached: its call fails by itself
