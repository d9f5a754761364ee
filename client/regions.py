"""The caller's side of response regions (kvferry.v1 SharedRegion): files in the folder shared with the sidecar, into
which it writes a response's tensor bytes instead of the messages.

Each client keeps a few such files and reuses them: the sidecar then writes into memory the folder already holds. A
fresh file per call cost as much in page allocation as skipping gRPC's copies saved.
A file is renamed before every call (a name serves one call), and goes back to its pool only once nothing views its
previous answer. Each file carries an exclusive flock while its client lives, so a new pool removes the files of
clients that died (a process's locks end with it)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import threading
import weakref

from kvferry.common.errors import InvalidInput
from kvferry.common.region_format import REGION_ALIGN, REGION_KEY_BYTES, REGION_NAME, region_header

log = logging.getLogger("kvferry.regions")


def _fresh_name() -> str:
    return "kvf-" + secrets.token_hex(16)


class _File:
    """One file of a pool: its descriptor (which holds the flock) and its current name."""

    def __init__(self, folder: str, size: int, mode: int):
        self.folder = folder
        self.spoiled = False  # its call failed: the sidecar may still be writing into it, so it is never reused
        self.name = "kvf-new-" + secrets.token_hex(
            16
        )  # no region name until it is locked: sweeps never see it unlocked
        self.key = b""
        self.fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(self.fd, mode)  # the process umask must not narrow what the sidecar's user needs
            os.ftruncate(self.fd, size)  # sparse: memory is taken only as the sidecar writes
            self.rename()
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

    def rekey(self) -> None:
        """A fresh key in the header: what the sidecar must be sent to write into this file for the next call."""
        self.key = secrets.token_bytes(REGION_KEY_BYTES)
        if os.pwrite(self.fd, region_header(self.key), 0) != REGION_ALIGN:
            raise OSError(f"could not write the header of response region {self.path}")

    def unlink(self) -> None:
        """Remove the name (an answer still mapped keeps its bytes until it is freed)."""
        if self.name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.name = ""

    def remove(self) -> None:
        self.unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
        self._out: set[_File] = set()  # leased, or viewed by an answer
        self._lock = threading.RLock()  # an answer's last view may be freed (and its file returned) on any thread
        self._closed = False
        self.failures = 0  # calls that found no region and were answered in their messages
        self.swept = sweep(folder)

    def lease(self) -> Lease | None:
        """A file for one call, under a fresh name and key; None when none can be had (the folder's memory is full,
        an idle file was removed by someone else): that call's answer then comes in its messages."""
        try:
            return self._lease()
        except OSError as e:
            self.failures += 1
            log.warning(
                "no response region in %s (%s): this answer comes in the messages", self.folder, e.strerror or e
            )
            return None

    def _lease(self) -> Lease:
        with self._lock:
            f = self._idle.pop() if self._idle else None
        if f is None:
            f = _File(self.folder, self.size, self.mode)
        else:
            try:
                f.rename()
            except OSError:
                f.remove()  # gone under us (another uid may unlink in a folder without the sticky bit): never leaked
                raise
        with self._lock:
            self._out.add(f)
        try:
            f.rekey()
        except OSError:
            f.spoiled = True
            self._returned(f)
            raise
        return Lease(self, f)

    def _returned(self, f: _File) -> None:
        """``f`` is free again: idle in the pool under a fresh key nobody was sent (the last call's key then opens
        nothing, and a sidecar call still holding the file writes no more), or removed."""
        with self._lock:
            self._out.discard(f)
            keep = not self._closed and not f.spoiled and len(self._idle) < self.keep
        if keep:
            try:
                f.rekey()
            except OSError:
                keep = False
        if keep:
            with self._lock:
                if not self._closed:
                    self._idle.append(f)
                    return
        f.remove()

    def close(self) -> None:
        """Remove every file of the pool from the folder now; an answer still viewed keeps its bytes (the mapping
        outlives the name) and its descriptor is closed once it is freed."""
        with self._lock:
            self._closed, idle, self._idle, out = True, self._idle, [], list(self._out)
        for f in idle:
            f.remove()
        for f in out:
            f.unlink()


class Lease:
    """One call's use of a pool file: ``name`` and ``size`` go in the request; ``view`` reads the answer's tensors
    from a mapping made for this call, which lives as long as they do. The file goes back to the pool when that
    mapping is gone, or at ``release`` when nothing was mapped."""

    def __init__(self, pool: RegionPool, f: _File):
        self.name, self.size, self.key = f.name, pool.size, f.key
        self._pool, self._file = pool, f
        self._map: mmap.mmap | None = None

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The ``nbytes`` at ``offset``, without a copy."""
        if offset + nbytes > self.size:
            raise InvalidInput(
                f"a response tensor's bytes [{offset}, {offset + nbytes}) run past the response region's "
                f"{self.size} bytes"
            )
        if self._map is None:
            if self._file is None:
                raise InvalidInput("this response region was released")
            self._map = mmap.mmap(self._file.fd, self.size, prot=mmap.PROT_READ)
            weakref.finalize(self._map, self._pool._returned, self._file)
        return memoryview(self._map)[offset : offset + nbytes]

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
