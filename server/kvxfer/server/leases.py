"""Page leases: the daemon hands out pool pages, so workers sharing it never pick the same ones.

Several engine processes (or TP ranks) share one daemon; each asks for pages
(``allocate``) instead of choosing them. A lease holds its pages until it is
released or expires; ``renew`` pushes its expiry out. A transfer may name the
lease its pages belong to: it then fails if the lease ends first (its pages may
be leased to someone else next), and with ``release_lease`` the lease ends with
the transfer, so a prefill engine can hand its pages to the daemon and forget
them: nobody pulls them, and they come back when the transfer's deadline or the
lease's expiry passes. Leases that end are announced on ``ended()``, which the
transfer coordinator reads to fail what still uses them.

Pages are handed out as the fewest runs that fit: the smallest free run that
holds them all, else the largest runs first. Explicit page runs (transfer verbs
without a lease) are not checked against leases: a deployment uses one or the
other per pool.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from kvxfer.errors import InvalidArgumentError, LeaseNotFoundError, PoolExhaustedError
from kvxfer.pages import PageRuns
from kvxfer.server.limits import check_id, check_text
from kvxfer.server.pools import PoolRegistry

log = logging.getLogger("kvxfer.server.leases")

#: Random bytes in a capability (128 bits).
CAPABILITY_BYTES = 16


@dataclass(eq=False)
class Lease:
    """Pages of one pool held by one holder until ``expires`` (``time.monotonic()``)."""

    id: str
    pool: str
    runs: PageRuns
    holder: str
    expires: float
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    #: What an offer of these pages holds (see ``kvxfer.server.transfers``): told only in the
    #: answer to the Allocate that made the lease.
    capability: str = field(default_factory=lambda: secrets.token_hex(CAPABILITY_BYTES), repr=False)
    #: Its capability went to an offer already (a later offer of its pages mints its own).
    capability_offered: bool = False

    def expires_in(self) -> float:
        """Seconds until it expires (0 when past)."""
        return max(0.0, self.expires - time.monotonic())

    def covers(self, runs: PageRuns) -> bool:
        """True when every page of ``runs`` is one of this lease's."""
        mine = set(self.runs.pages())
        return all(page in mine for page in runs.pages())


class FreePages:
    """The free pages of one pool."""

    def __init__(self, num_pages: int) -> None:
        self._free = np.ones(num_pages, dtype=bool)

    @property
    def count(self) -> int:
        """Free pages."""
        return int(self._free.sum())

    def _runs(self) -> list[tuple[int, int]]:
        """Every maximal run of free pages, as (start, count)."""
        padded = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]

    def take(self, pages: int) -> PageRuns | None:
        """``pages`` free pages as the fewest runs (now leased), or None if too few are free."""
        if pages > self.count:
            return None
        runs = self._runs()
        fits = [run for run in runs if run[1] >= pages]
        if fits:
            start, _ = min(fits, key=lambda run: run[1])
            taken = [(start, pages)]
        else:
            taken, left = [], pages
            for start, count in sorted(runs, key=lambda run: -run[1]):
                taken.append((start, min(count, left)))
                left -= taken[-1][1]
                if left == 0:
                    break
        for start, count in taken:
            self._free[start:start + count] = False
        return PageRuns.of(sorted(taken))

    def give_back(self, runs: PageRuns) -> None:
        """Pages of an ended lease are free again."""
        for run in runs.runs:
            self._free[run.start:run.stop] = True


class PageLeases:
    """Grants, renews, releases and expires the page leases of every pool."""

    def __init__(self, pools: PoolRegistry, default_lease_s: float) -> None:
        self._pools = pools
        self.default_lease_s = default_lease_s
        self._free = {p.name: FreePages(p.descriptor.num_pages) for p in pools.all()}
        self._leases: dict[str, Lease] = {}
        self._ended: asyncio.Queue[tuple[Lease, str]] = asyncio.Queue()

    def _duration(self, lease_s: float) -> float:
        if not 0 <= lease_s < float("inf"):
            raise InvalidArgumentError(f"lease_s={lease_s} must be 0 (the default) or a positive "
                                    "number of seconds")
        return lease_s or self.default_lease_s

    def allocate(self, pool: str, pages: int, lease_s: float, holder: str) -> Lease:
        """Lease ``pages`` free pages of ``pool`` for ``lease_s`` seconds (0: the default)."""
        check_text("holder", holder)
        num_pages = self._pools.get(pool).descriptor.num_pages
        duration = self._duration(lease_s)
        if not 1 <= pages <= num_pages:
            raise InvalidArgumentError(f"pages={pages}; pool {pool!r} has {num_pages}, so expected "
                                    f"1 to {num_pages}")
        runs = self._free[pool].take(pages)
        if runs is None:
            raise PoolExhaustedError(
                f"pool {pool!r} has {self._free[pool].count} free pages, {pages} were asked "
                f"for; {num_pages - self._free[pool].count} are leased")
        lease = Lease(secrets.token_hex(8), pool, runs, holder, time.monotonic() + duration)
        self._leases[lease.id] = lease
        self._arm(lease, duration)
        return lease

    def _arm(self, lease: Lease, duration: float) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        lease.timer = asyncio.get_running_loop().call_later(duration, self._expire, lease)

    def get(self, lease_id: str) -> Lease:
        """The live lease ``lease_id``; raises LeaseNotFoundError (InvalidArgumentError for an
        id no lease can have: empty or too long)."""
        check_id("lease_id", lease_id)
        try:
            return self._leases[lease_id]
        except KeyError:
            raise LeaseNotFoundError(
                f"no lease {lease_id!r} is held here (never granted, released, or expired)"
            ) from None

    def held(self, lease_id: str) -> bool:
        """True while the lease ``lease_id`` is live."""
        return lease_id in self._leases

    def renew(self, lease_id: str, lease_s: float) -> Lease:
        """Push the lease's expiry to ``lease_s`` seconds from now (0: the default)."""
        lease = self.get(lease_id)
        duration = self._duration(lease_s)
        lease.expires = time.monotonic() + duration
        self._arm(lease, duration)
        return lease

    def release(self, lease_id: str, why: str = "released") -> Lease:
        """End the lease now: its pages are free; transfers still using it will fail."""
        lease = self.get(lease_id)
        self._end(lease, why)
        return lease

    def _expire(self, lease: Lease) -> None:
        if self._leases.get(lease.id) is lease:
            log.warning("lease %s of %s (%s) expired", lease.id, lease.holder or "?", lease.pool)
            self._end(lease, "expired")

    def _end(self, lease: Lease, why: str) -> None:
        del self._leases[lease.id]
        if lease.timer is not None:
            lease.timer.cancel()
        self._free[lease.pool].give_back(lease.runs)
        self._ended.put_nowait((lease, why))

    async def ended(self) -> AsyncIterator[tuple[Lease, str]]:
        """Every lease as it ends, with why ("released", "expired", ...)."""
        while True:
            yield await self._ended.get()

    def leased_pages(self, pool: str) -> int:
        """Pages of ``pool`` under a lease."""
        return self._pools.get(pool).descriptor.num_pages - self._free[pool].count

    def all(self) -> list[Lease]:
        """Every live lease, oldest first."""
        return list(self._leases.values())
