"""One transfer from a prefill daemon to a decode daemon, driven from one place.

What a disaggregated deployment does per request, in the right order: in push
mode the decode side expects the pages and the prefill side pushes them; in
pull mode the prefill side offers them and the decode side pulls. Then it waits
for both sides. If the side that drives the transfer fails, the other side is
aborted at once (as an engine would) instead of running into its deadline. The
demo, ``kvxfer bench`` and the benchmarks all move pages through ``hand_off``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvxfer.client.library import KvxferClient
from kvxfer.pages import PageRuns
from kvxfer.status import TransferInfo


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
    raise their ``kvxfer.errors`` type; how the transfer ended is in the result.
    """
    if mode == "push":
        decode.expect(transfer_id, pool, dst, timeout_s=timeout_s)
        prefill.push(transfer_id, pool, src, peer=decode_peer, timeout_s=timeout_s, verify=verify)
        first, second = prefill, decode
    else:
        prefill.offer(transfer_id, pool, src, timeout_s=timeout_s, verify=verify)
        decode.pull(transfer_id, prefill_peer, pool, dst, timeout_s=timeout_s)
        first, second = decode, prefill
    driver = first.wait(transfer_id, timeout_s=timeout_s + 5)
    if not driver.ok:
        other = second.abort(transfer_id, f"the other side ended {driver.state.name}")
    else:
        other = second.wait(transfer_id, timeout_s=timeout_s + 5)
    sent, received = (driver, other) if mode == "push" else (other, driver)
    return Handoff(sent, received, mode)
