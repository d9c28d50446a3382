"""``kvxfer serve`` with some of its trust guards switched off: the tests' seam for the
negative controls that run through real engines (``vllm_unguarded.py``). The production
daemon has no such switch.

usage: python tests/unguarded_daemon.py GUARDS SERVE-ARGS...

GUARDS is a comma-separated list of:
- ``capability``: every capability presented is taken (a pull, a claim, an abort);
- ``digest``: every prompt digest is taken as the offer's;
- ``dial``: every peer address may be dialled.
"""

from __future__ import annotations

import sys

from kvxfer.client.cli import main
from kvxfer.server import dial_policy
from kvxfer.server.transfers import coordinator, receiver, sender


def unguarded(guards: set[str]) -> None:
    """Switch ``guards`` off in this process."""
    if "capability" in guards:
        for module in (coordinator, receiver, sender):
            module.presents = lambda given, held: True  # type: ignore[attr-defined]
    if "digest" in guards:
        sender.same_prompt = lambda presented, recorded: True  # type: ignore[attr-defined]
    if "dial" in guards:
        async def anywhere(self: dial_policy.DialPolicy, address: str) -> None:
            return None
        dial_policy.DialPolicy.check = anywhere  # type: ignore[method-assign]


if __name__ == "__main__":
    unguarded(set(sys.argv[1].split(",")))
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    sys.exit(main())
