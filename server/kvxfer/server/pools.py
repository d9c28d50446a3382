"""The pools a daemon serves: their arenas (memory), layouts and descriptors."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvxfer.descriptor import PoolDescriptor
from kvxfer.errors import PoolNotFoundError
from kvxfer.layout import pack_arena
from kvxfer.local_copy import ArenaFile, describe_arena
from kvxfer.memory import Arena, create_arena, remove_stale_arenas
from kvxfer.pages import Extent, PageRuns, map_extents
from kvxfer.server.config import ArenaConfig

log = logging.getLogger("kvxfer.server.pools")


@dataclass(frozen=True)
class Pool:
    """A served pool: where it lives and how it is laid out."""

    descriptor: PoolDescriptor
    arena: Arena

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.descriptor.name

    def extents(self, runs: PageRuns) -> tuple[Extent, ...]:
        """The byte extents of ``runs`` in the arena (src == dst == the offset)."""
        runs.check_bounds(self.descriptor.num_pages, what=f"pool {self.name!r} pages")
        layout = self.descriptor.layout
        return map_extents(
            runs, runs, page_bytes=layout.page_bytes,
            src_anchor=layout.anchor_bytes, dst_anchor=layout.anchor_bytes,
        )


class PoolRegistry:
    """Allocates every configured arena and indexes its pools by name."""

    def __init__(self, arenas: tuple[ArenaConfig, ...], shm_dir: str = "/dev/shm",
                 group: int | None = None) -> None:
        #: This start's memory epoch, on every arena's handle: workers that mapped an
        #: earlier daemon's arenas are told apart from those that mapped these.
        self.epoch = secrets.token_hex(16)
        self._arenas: list[Arena] = []
        self._pools: dict[str, Pool] = {}
        if any(cfg.device == "cpu" for cfg in arenas) and Path(shm_dir).is_dir():
            for path, nbytes in remove_stale_arenas(shm_dir):
                log.warning("removed %s (%d bytes): left by a daemon that died without "
                            "cleaning up", path, nbytes)
        try:
            for cfg in arenas:
                layouts, size = pack_arena([p.spec for p in cfg.pools])
                arena = create_arena(cfg.name, size, cfg.device, shm_dir, group, self.epoch)
                self._arenas.append(arena)
                for pool_cfg, layout in zip(cfg.pools, layouts):
                    desc = PoolDescriptor(pool_cfg.name, layout)
                    self._pools[desc.name] = Pool(desc, arena)
                log.info(
                    "arena %s: %d bytes on %s, pools %s",
                    cfg.name, size, cfg.device, [p.name for p in cfg.pools],
                )
        except BaseException:
            self.close()
            raise

    def get(self, name: str) -> Pool:
        """The pool called ``name``; raises PoolNotFoundError listing the served ones."""
        try:
            return self._pools[name]
        except KeyError:
            raise PoolNotFoundError(
                f"no pool named {name!r}; this daemon serves {sorted(self._pools)}"
            ) from None

    def all(self) -> list[Pool]:
        """Every pool, in config order."""
        return list(self._pools.values())

    def arena_files(self) -> dict[str, ArenaFile]:
        """The file behind each CPU pool's arena, by pool name (for same-host peers)."""
        files = {p.name: describe_arena(p.arena) for p in self._pools.values()}
        return {name: f for name, f in files.items() if f is not None}

    def descriptors(self) -> list[PoolDescriptor]:
        """Every pool's descriptor, in config order."""
        return [p.descriptor for p in self._pools.values()]

    def close(self) -> None:
        """Release every arena (unlinks shared-memory files)."""
        for arena in self._arenas:
            arena.close()
        self._arenas.clear()
