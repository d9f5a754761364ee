"""The response region's format, shared by the client that owns a region and the sidecar that writes into it: its
name, its header (magic and the call's key) and where tensors lie in it."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import torch

from kvferry.common.errors import InvalidInput
from kvferry.common.tensors import nbytes

REGION_NAME = re.compile(r"kvf-[0-9a-f]{32}")
"""A SharedRegion's name: "kvf-" and 32 lowercase hex digits (128 random bits), a plain file name in the shared
folder."""


REGION_FOLDER_MODE = 0o3770
"""The shared folder's permissions when kvferry prepares it (``kvferry shm-folder``, the chart's init container):
its owner and group may create files (the group is the pod's fsGroup, so a sidecar and a model server running as
different users both belong), nobody else may enter; sticky, so each user may remove only its own files (a client
of another uid can neither sweep nor replace this client's regions); set-group-ID, so every file in it takes the
folder's group (what SharedMemory.file_mode 0o660 shares)."""


def prepare_region_folder(path: str | Path) -> Path:
    """Make ``path`` (a folder on the shared memory volume) the response regions' folder: created if missing, with
    REGION_FOLDER_MODE. Refuses a path that exists as anything but a plain folder (a link included)."""
    p = Path(path)
    if not p.is_absolute():
        raise InvalidInput(f"the shared folder must be an absolute path (the one both containers mount), got {p}")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InvalidInput(f"{p} exists and is not a folder; give a folder on the shared memory volume") from None
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidInput(f"{p} is a link or not a folder; give the folder itself, on the shared memory volume")
    os.chmod(p, REGION_FOLDER_MODE)
    return p


REGION_ALIGN = 64
"""Tensors in a response region start at multiples of this many bytes."""


REGION_MAGIC = b"kvfregn1"
"""A response region's header: these 8 bytes, then the call's key, then zeros to REGION_ALIGN."""


REGION_KEY_BYTES = 32
"""A response region's key: random bytes the caller writes into the header and sends in the request."""


def region_header(key: bytes) -> bytes:
    """The first REGION_ALIGN bytes of a region file holding ``key``."""
    return (REGION_MAGIC + key).ljust(REGION_ALIGN, b"\0")


def region_view(region, offset: int, dtype: torch.dtype, shape) -> memoryview:
    """The bytes of a response tensor at ``offset`` of ``region`` (an object whose ``view(offset, nbytes)`` returns
    them, or raises InvalidInput when they lie outside it)."""
    if region is None:
        raise InvalidInput(
            "a response tensor lies in a response region, but this call has none (it named none, or the "
            "response header said the sidecar did not take it)"
        )
    if offset % REGION_ALIGN:
        raise InvalidInput(f"a response tensor's region_offset {offset} is not a multiple of {REGION_ALIGN}")
    return region.view(offset, nbytes(dtype, shape))
