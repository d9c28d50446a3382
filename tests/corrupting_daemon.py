"""``kvxfer serve`` whose receiver flips the first byte of transfers it receives, and never
asks for rank 0's shard (or part 0 of an offer shared by several ranks) of a transfer whose
id contains ``STALL``: the tests' fault double (the production receiver has no such hook).

usage: python tests/corrupting_daemon.py MARKER SERVE-ARGS...

MARKER "1" corrupts every received transfer, any other value those whose id contains it.
The flip happens once every byte has landed and before checksums are checked, so a
verified transfer fails its checksum and an unverified one completes with the flipped byte.
A stalled pull waits for its deadline, or for an abort.
"""

from __future__ import annotations

import sys

from kvxfer.client.cli import main
from kvxfer.server.transfers.receiver import Receiver
from kvxfer.server.transfers.record import Transfer


def corrupting(marker: str) -> None:
    """Make every ``Receiver`` of this process flip a byte of the transfers ``marker`` picks."""
    landed = Receiver._landed

    def flip_then_land(self: Receiver, t: Transfer) -> None:
        if marker == "1" or marker in t.id:
            t.pool.arena.raw[t.chunks[0].dst_offset].bitwise_not_()
        landed(self, t)

    Receiver._landed = flip_then_land  # type: ignore[method-assign]


#: A transfer whose id contains this has its rank 0 shard (``.../tp0``), or its part 0
#: (``...#0``), never asked for.
STALL = "stall-rank0"


def stalling() -> None:
    """Make every ``Receiver`` of this process leave rank 0's pull (or part 0's) of a
    ``STALL`` transfer waiting."""
    start_pull = Receiver.start_pull

    def maybe_start(self: Receiver, t: Transfer) -> None:
        if not (STALL in t.id and t.id.endswith(("/tp0", "#0"))):
            start_pull(self, t)

    Receiver.start_pull = maybe_start  # type: ignore[method-assign]


if __name__ == "__main__":
    corrupting(sys.argv[1])
    stalling()
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    sys.exit(main())
