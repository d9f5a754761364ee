"""Response regions: a caller's file in the folder it shares with the sidecar, which the response's tensor bytes go
into instead of the messages (kvferry.v1 SharedRegion). One folder per sidecar, opened once; one file per call,
opened by name, taken only if its header holds the call's key (the caller proves it can read the file: a name alone,
which anyone who can list the folder sees, is not enough), written with pwritev straight from the blocks' pieces,
never past the file's end, and closed when the call ends. The file is the caller's: the sidecar never creates,
renames or removes one."""

from __future__ import annotations

import errno
import hmac
import logging
import os
import stat
import threading

from kvferry.common.errors import InvalidInput
from kvferry.common.region_format import REGION_ALIGN, region_header

log = logging.getLogger("kvferry.regions")

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class ResponseRegion:
    """One call's region: ``put`` writes a tensor's pieces at the next aligned offset that leaves them within
    ``capacity``, or answers None (the tensor then goes in its message). A write that fails (the folder's memory is
    full) answers None too, and no later tensor is tried. Before each write the file's header must still hold the
    call's ``key``: once its owner has rekeyed it (for its next call, or back in its pool), this call writes no more."""

    def __init__(self, fd: int, capacity: int, key: bytes):
        self.fd, self.capacity, self.header = fd, capacity, region_header(key)
        self.used = REGION_ALIGN  # the caller's header
        self.full = False
        self._lock = threading.Lock()  # encoding runs on the event loop (stored blocks) and the compute thread

    def put(self, pieces: list, size: int) -> int | None:
        with self._lock:
            offset = -(-self.used // REGION_ALIGN) * REGION_ALIGN
            if self.full or self.fd < 0 or offset + size > self.capacity:
                return None
            try:
                if offset + size > os.fstat(self.fd).st_size:  # the caller shrank it: never grow its file
                    self.full = True
                    return None
                if not hmac.compare_digest(os.pread(self.fd, REGION_ALIGN, 0), self.header):
                    self.full = True  # rekeyed by its owner: no longer this call's file
                    log.warning(
                        "response region rekeyed by its owner during the call: the rest of the answer goes "
                        "in the messages"
                    )
                    return None
                _pwrite_all(self.fd, pieces, offset)
            except OSError as e:
                self.full = True
                log.warning("response region write failed (%s): the rest of the answer goes in the messages", e)
                return None
            self.used = offset + size
            return offset

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _pwrite_all(fd: int, pieces: list, offset: int) -> None:
    """Write ``pieces`` back to back from ``offset``: pwritev in batches of IOV_MAX, resuming after short writes."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        batch = views[:_IOV_MAX]
        n = os.pwritev(fd, batch, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while n and views:  # drop what was written; keep the rest of a piece written in part
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


class RegionFolder:
    """The sidecar's --shm-dir, held open (names resolve against it, not against a path that could be swapped)."""

    def __init__(self, path: str, metrics=None):
        self.path, self.metrics = path, metrics
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise InvalidInput(
                f"shm_dir {path}: {e.strerror}; mount the volume shared with the model server there, "
                "or leave shm_dir empty"
            ) from None

    def take(self, name: str, size: int, key: bytes) -> ResponseRegion | None:
        """The caller's file ``name`` (already checked to be a plain region name) as this call's region; None when
        there is no such regular, singly linked file whose header holds ``key`` (the answer then goes in the
        messages)."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
        except OSError as e:
            return self._refused(f"cannot open it: {e.strerror}")
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            return self._refused(f"cannot take it: {e.strerror}")
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            return self._refused("not a regular file with one link")
        try:
            header = os.pread(fd, REGION_ALIGN, 0)
        except OSError as e:
            os.close(fd)
            return self._refused(f"cannot read its header: {e.strerror}")
        if not hmac.compare_digest(header, region_header(key)):
            os.close(fd)
            return self._refused("its header does not hold this call's key", "refused")
        self._count("taken")
        return ResponseRegion(fd, min(size, st.st_size), key)

    def _refused(self, why: str, outcome: str = "ignored") -> None:
        log.warning("response region ignored (%s); the answer goes in the messages", why)
        self._count(outcome)
        return None

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.response_regions.labels(outcome).inc()

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
