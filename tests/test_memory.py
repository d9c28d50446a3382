"""Arena memory: what a worker's attach accepts as the daemon's shared-memory file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvxfer.errors import AttachError
from kvxfer.memory import attach, create_arena


def test_attach_maps_a_file_rounded_up_to_its_block_size(tmp_path: Path) -> None:
    """hugetlbfs rounds every file up to a whole huge page; the arena is still its first bytes."""
    arena = create_arena("kv", 1000, "cpu", shm_dir=str(tmp_path))
    try:
        path = arena.handle.shm.path
        os.truncate(path, os.stat(path).st_blksize)  # what hugetlbfs does to a 1000-byte file
        mapping = attach(arena.handle)
        assert mapping.raw.numel() == 1000
        arena.raw[999] = 7
        assert int(mapping.raw[999]) == 7
        mapping.close()
    finally:
        arena.close()


@pytest.mark.parametrize("size", ["short", "a block too long"])
def test_attach_refuses_a_file_of_another_size(tmp_path: Path, size: str) -> None:
    arena = create_arena("kv", 1000, "cpu", shm_dir=str(tmp_path))
    try:
        path = arena.handle.shm.path
        block = os.stat(path).st_blksize
        os.truncate(path, 999 if size == "short" else 2 * block)
        with pytest.raises(AttachError, match="expected 1000"):
            attach(arena.handle)
    finally:
        arena.close()
