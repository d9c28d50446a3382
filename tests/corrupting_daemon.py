"""``kvxfer serve`` whose receiver flips the first byte of transfers it receives: the tests'
fault double (the production receiver has no such hook).

usage: python tests/corrupting_daemon.py MARKER SERVE-ARGS...

MARKER "1" corrupts every received transfer, any other value those whose id contains it.
The flip happens once every byte has landed and before checksums are checked, so a
verified transfer fails its checksum and an unverified one completes with the flipped byte.
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


if __name__ == "__main__":
    corrupting(sys.argv[1])
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    sys.exit(main())
