"""Raw pool memory that two processes on one node can map: shared memory or CUDA IPC.

The daemon *owns* an ``Arena`` (one raw ``uint8`` buffer that holds one or more
pools); a worker *attaches* to it from the ``MemoryHandle`` the daemon
advertises and gets a tensor over the very same bytes (zero copy).

- CPU: a file in ``/dev/shm`` (owner-only permissions), mapped with mmap. The
  daemon unlinks it on close, and holds an exclusive ``flock`` on it while it
  lives, so the file of a daemon that was killed (SIGKILL, OOM) is recognisably
  stale: ``remove_stale_arenas`` (run at every daemon start) deletes it. The
  lock works across PID namespaces, unlike checking whether a pid is alive.
- CUDA: ``torch.empty`` on the device, shared with CUDA IPC handles, the same
  mechanism ``torch.multiprocessing`` uses.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvxfer.errors import AttachError, InvalidSpecError


@dataclass(frozen=True)
class SharedMemoryHandle:
    """A CPU arena: a file (in ``/dev/shm`` or the configured directory) to map."""

    path: str


@dataclass(frozen=True)
class CudaIpcHandle:
    """A CUDA arena shared with CUDA IPC: the fields ``torch.multiprocessing`` uses."""

    device: int
    storage_handle: bytes
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class MemoryHandle:
    """How another process on this node attaches to an arena (exactly one of shm, cuda).

    ``epoch`` is the memory epoch of the daemon that created it (random, minted at each
    start): a mapping is current only while it equals the daemon's epoch."""

    arena: str
    device: str
    size_bytes: int
    shm: SharedMemoryHandle | None = None
    cuda: CudaIpcHandle | None = None
    epoch: str = ""

    @property
    def kind(self) -> str:
        """``shm``, ``cuda``, or "" when the handle names no memory."""
        return "shm" if self.shm is not None else "cuda" if self.cuda is not None else ""


@dataclass
class Arena:
    """One raw buffer owned by this process; close() releases it (and its shm file)."""

    name: str
    device: str
    raw: torch.Tensor
    handle: MemoryHandle
    _mmap: mmap.mmap | None = None
    _path: Path | None = None
    _host: Any = None
    _lock_fd: int | None = None

    @property
    def size_bytes(self) -> int:
        """Bytes of the buffer."""
        return self.raw.numel()

    def buffer(self, offset: int, nbytes: int) -> Any:
        """An object UCX can send from or receive into: ``nbytes`` at ``offset``, zero copy."""
        if self.raw.device.type != "cpu":
            return self.raw[offset : offset + nbytes]
        if self._host is None:
            self._host = self.raw.numpy()  # slicing numpy is ~10x cheaper than torch
        return self._host[offset : offset + nbytes]

    def close(self) -> None:
        """Release the memory; the shm file is unlinked first so it never outlives us."""
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.raw = torch.empty(0, dtype=torch.uint8)
        self._host = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # views are still referenced; the mapping goes when they do
            self._mmap = None


def create_arena(name: str, size_bytes: int, device: str, shm_dir: str = "/dev/shm",
                 group: int | None = None, epoch: str = "") -> Arena:
    """Allocate a zeroed buffer of ``size_bytes`` on ``device`` ("cpu" or "cuda:N"), its
    handle marked with the memory ``epoch``. A CPU buffer's file is the owner's only (mode
    0600), or with ``group`` (a gid) that group's too (0660)."""
    if size_bytes <= 0:
        raise InvalidSpecError(f"arena {name!r} size_bytes={size_bytes} must be positive")
    if device == "cpu":
        arena = _create_shm(name, size_bytes, shm_dir, group)
    elif device.startswith("cuda"):
        arena = _create_cuda(name, size_bytes, device)
    else:
        raise InvalidSpecError(f"device={device!r} is not supported; expected 'cpu' or 'cuda:N'")
    arena.handle = dataclasses.replace(arena.handle, epoch=epoch)
    return arena


SHM_PREFIX = "kvxfer-"


def _create_shm(name: str, size_bytes: int, shm_dir: str, group: int | None) -> Arena:
    token = f"{os.getpid()}-{name}-{secrets.token_hex(4)}"
    # Created and locked under a name the stale-file sweep ignores, then renamed:
    # a sweep running in another daemon can never take a file that is being born.
    tmp = Path(shm_dir) / f".{SHM_PREFIX}{token}"
    path = Path(shm_dir) / f"{SHM_PREFIX}{token}"
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        raise InvalidSpecError(
            f"cannot create shared memory for arena {name!r} in {shm_dir!r}: {exc.strerror}; "
            f"shm_dir must be an existing, writable tmpfs directory such as /dev/shm"
        ) from None
    try:
        if group is not None:
            os.fchown(fd, -1, group)
            os.fchmod(fd, 0o660)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Reserve the memory now: a full /dev/shm fails here with ENOSPC, not later
        # with SIGBUS in the middle of a transfer.
        os.posix_fallocate(fd, 0, size_bytes)
        mapping = _map(fd, size_bytes)
        os.rename(tmp, path)
    except OSError as exc:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise InvalidSpecError(
            f"cannot allocate {size_bytes} bytes of shared memory for arena {name!r} in "
            f"{shm_dir}: {exc.strerror} ({_free_bytes(shm_dir)} bytes free there); give it a "
            "larger tmpfs (docker: --shm-size) or configure fewer pages"
        ) from None
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    handle = MemoryHandle(name, "cpu", size_bytes, shm=SharedMemoryHandle(str(path)))
    return Arena(name, "cpu", raw, handle, mapping, path, _lock_fd=fd)


def _free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def remove_stale_arenas(shm_dir: str = "/dev/shm", pid: int | None = None) -> list[tuple[Path, int]]:
    """Delete arena files whose daemon is gone (nobody holds their lock): ``(path, bytes)`` each.

    ``pid`` limits the sweep to the files one daemon process created.
    """
    removed: list[tuple[Path, int]] = []
    pattern = f"{SHM_PREFIX}{pid}-*" if pid is not None else f"{SHM_PREFIX}*"
    for path in Path(shm_dir).glob(pattern):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue  # gone already, or not ours to touch
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its daemon is alive
        else:
            removed.append((path, os.fstat(fd).st_size))
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed


def _map(fd: int, size_bytes: int) -> mmap.mmap:
    """Map shared memory with its page tables filled in (MAP_POPULATE).

    Without it, every process faults in each 4 KiB page on first touch, and UCX's
    cross-process copies pay for those faults inside the transfer (measured: a
    256 MiB transfer ran at a third of its speed until every page had been touched).
    """
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size_bytes, flags=flags)


def _create_cuda(name: str, size_bytes: int, device: str) -> Arena:
    raw = torch.zeros(size_bytes, dtype=torch.uint8, device=device)
    storage = raw.untyped_storage()
    # torch.multiprocessing's own (untyped) sharing call.
    (dev, handle, _size, offset, ref_handle, ref_offset, event, sync) = (
        storage._share_cuda_())  # type: ignore[no-untyped-call]
    ipc = CudaIpcHandle(dev, handle, offset, ref_handle, ref_offset, event or b"", sync)
    return Arena(name, device, raw, MemoryHandle(name, device, size_bytes, cuda=ipc))


def _check_file_size(fd: int, handle: MemoryHandle, path: str) -> None:
    """Refuse a file that cannot be the arena ``handle`` describes.

    The file holds ``size_bytes``, rounded up to its file system's block size:
    hugetlbfs (Kubernetes' ``HugePages`` volumes) allocates whole huge pages, so
    a 96 KiB arena there is a 2 MiB file.
    """
    info = os.fstat(fd)
    block = max(1, info.st_blksize)
    largest = -(-handle.size_bytes // block) * block
    if not handle.size_bytes <= info.st_size <= largest:
        raise AttachError(
            f"shared memory {path!r} has {info.st_size} bytes, expected "
            f"{handle.size_bytes} (up to {largest} on a file system with {block}-byte blocks); "
            f"is it another daemon's file?"
        )


@dataclass
class Mapping:
    """A worker's mapping of a daemon's arena; close() unmaps it."""

    raw: torch.Tensor
    _mmap: mmap.mmap | None = None

    def close(self) -> None:
        """Drop the mapping (views built on it must not be used afterwards)."""
        self.raw = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # the caller still holds views; the mapping goes with them
            self._mmap = None


def attach(handle: MemoryHandle) -> Mapping:
    """Map the buffer described by ``handle`` into this process (same node only)."""
    if handle.shm is not None:
        path = handle.shm.path
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise AttachError(
                f"cannot open shared memory {path!r} of arena {handle.arena!r}: "
                f"{exc.strerror}; the worker must run on the daemon's node and share /dev/shm"
            ) from None
        try:
            _check_file_size(fd, handle, path)
            mapping = _map(fd, handle.size_bytes)
        finally:
            os.close(fd)
        return Mapping(torch.frombuffer(mapping, dtype=torch.uint8), mapping)
    if handle.cuda is not None:
        ipc = handle.cuda
        storage = torch.UntypedStorage._new_shared_cuda(
            ipc.device,
            ipc.storage_handle,
            handle.size_bytes,
            ipc.storage_offset_bytes,
            ipc.ref_counter_handle,
            ipc.ref_counter_offset,
            ipc.event_handle or None,
            ipc.event_sync_required,
        )
        raw = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ipc.device}")
        raw.set_(storage, 0, (handle.size_bytes,), (1,))
        return Mapping(raw)
    raise AttachError(f"memory handle of arena {handle.arena!r} names no memory kind")
