"""The caller's side of response regions (kvferry.v1 SharedRegion): files in the folder shared with the sidecar, into
which it writes a response's tensor bytes instead of the messages.

Each client keeps a few such files and reuses them: the sidecar then writes into memory the folder already holds. A
fresh file per call cost as much in page allocation as skipping gRPC's copies saved (docs/benchmarks.md, session 28).
A file is renamed before every call (a name serves one call), and goes back to its pool only once nothing views its
previous answer. Each file carries an exclusive flock while its client lives, so a new pool removes the files of
clients that died (a process's locks end with it)."""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import threading
import weakref

from kvferry.common.wire import REGION_NAME
from kvferry.mappings.errors import InvalidInput


def _fresh_name() -> str:
    return "kvf-" + secrets.token_hex(16)


class _File:
    """One file of a pool: its descriptor (which holds the flock) and its current name."""

    def __init__(self, folder: str, size: int, mode: int):
        self.folder = folder
        self.spoiled = False  # its call failed: the sidecar may still be writing into it, so it is never reused
        self.name = _fresh_name()
        self.fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails only if a sweeper took it first: retried
        except BaseException:
            os.close(self.fd)  # the sweeper that holds it removes it
            raise
        try:
            os.fchmod(self.fd, mode)  # the process umask must not narrow what the sidecar's user needs
            os.ftruncate(self.fd, size)  # sparse: memory is taken only as the sidecar writes
        except BaseException:
            self.remove()  # ours: nobody else would remove it until the next pool's sweep
            raise

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.name)

    def rename(self) -> None:
        old = self.path
        self.name = _fresh_name()
        os.rename(old, self.path)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)


def sweep(folder: str) -> int:
    """Remove the region files in ``folder`` whose client died (nobody holds their flock); returns how many."""
    removed = 0
    for name in os.listdir(folder):
        if not REGION_NAME.fullmatch(name):
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # renamed or removed meanwhile, or not a file we may open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live client's
            continue
        path = os.path.join(folder, name)
        try:
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:  # still the file that was locked
                os.unlink(path)
                removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class RegionPool:
    """A client's region files in ``folder``, ``size`` bytes each: up to ``keep`` idle ones are kept for reuse."""

    def __init__(self, folder: str, size: int, mode: int = 0o600, keep: int = 4):
        self.folder, self.size, self.mode, self.keep = folder, size, mode, keep
        self._idle: list[_File] = []
        self._lock = threading.RLock()  # an answer's last view may be freed (and its file returned) on any thread
        self._closed = False
        self.swept = sweep(folder)

    def lease(self) -> "Lease":
        """A file for one call, under a fresh name."""
        with self._lock:
            f = self._idle.pop() if self._idle else None
        if f is None:
            for _ in range(3):
                try:
                    f = _File(self.folder, self.size, self.mode)
                    break
                except BlockingIOError:  # a sweeper locked the new file first; it removes it
                    continue
            else:
                raise OSError(f"could not create a response region in {self.folder}")
        else:
            f.rename()
        return Lease(self, f)

    def _returned(self, f: _File) -> None:
        with self._lock:
            if not self._closed and not f.spoiled and len(self._idle) < self.keep:
                self._idle.append(f)
                return
        f.remove()

    def close(self) -> None:
        """Remove the idle files; a file whose answer is still viewed is removed once it is not."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for f in idle:
            f.remove()


class Lease:
    """One call's use of a pool file: ``name`` and ``size`` go in the request; ``view`` reads the answer's tensors
    from a mapping made for this call, which lives as long as they do. The file goes back to the pool when that
    mapping is gone, or at ``release`` when nothing was mapped."""

    def __init__(self, pool: RegionPool, f: _File):
        self.name, self.size = f.name, pool.size
        self._pool, self._file = pool, f
        self._map: mmap.mmap | None = None

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The ``nbytes`` at ``offset``, without a copy."""
        if offset + nbytes > self.size:
            raise InvalidInput(f"a response tensor's bytes [{offset}, {offset + nbytes}) run past the response region's "
                               f"{self.size} bytes")
        if self._map is None:
            if self._file is None:
                raise InvalidInput("this response region was released")
            self._map = mmap.mmap(self._file.fd, self.size, prot=mmap.PROT_READ)
            weakref.finalize(self._map, self._pool._returned, self._file)
        return memoryview(self._map)[offset:offset + nbytes]

    def release(self, ok: bool) -> None:
        """The call is over: drop the lease's own hold (the answer's tensors keep the mapping while they live). A
        call that did not end with its answer (``ok`` false) spoils the file: a sidecar still at work on it may
        write on, so it is removed, never reused."""
        f, self._file = self._file, None
        if f is None:
            return
        f.spoiled = f.spoiled or not ok
        if self._map is None:
            self._pool._returned(f)
        self._map = None
