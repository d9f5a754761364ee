"""Reading the small files an operator names (secrets, tokens, certificates): regular files only, read with a limit.

A FIFO named as a secret file would block a reader until something writes to it, and ``/dev/zero`` would be read
until memory runs out; both are refused, as is a file larger than its kind allows. The file is opened without
blocking and checked on the open descriptor, so a swap between the check and the read changes nothing.
"""

from __future__ import annotations

import os
import stat

from kvferry.common.errors import InvalidInput

SECRET_LIMIT = 64 << 10
"""Largest secret, token or password file: far above any real one."""
PEM_LIMIT = 1 << 20
"""Largest certificate, key or CA bundle, and tokens file."""


def read_small_file(path: str, what: str, limit: int = SECRET_LIMIT) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit``); ``what`` names the setting in every refusal."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InvalidInput(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(
                f"{what} {path} is not a regular file (a FIFO, device or folder cannot hold it); "
                "point it at the mounted secret's file"
            )
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise InvalidInput(f"{what} {path} is larger than {limit} bytes; is it the right file?")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_secret_text(path: str, what: str, limit: int = SECRET_LIMIT) -> str:
    """A secret file's text, surrounding whitespace stripped."""
    try:
        return read_small_file(path, what, limit).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidInput(f"{what} {path} is not UTF-8 text") from None
