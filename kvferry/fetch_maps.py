"""``kvferry maps fetch``: download a .tar.gz of map artifacts and unpack it safely (initContainers)."""

from __future__ import annotations

import tarfile
import tempfile
import urllib.request
from pathlib import Path

from kvferry.mappings.artifact import load
from kvferry.mappings.errors import ArtifactError


def fetch(url: str, dest: Path, max_bytes: int = 4 << 30) -> list[Path]:
    """Unpack into ``dest`` (no absolute paths, links or '..': tarfile's "data" filter) and verify each artifact."""
    if not url.startswith(("https://", "http://", "file://")):
        raise ArtifactError(f"unsupported URL scheme in {url!r}; use https://")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tmp:
        with urllib.request.urlopen(url, timeout=60) as resp:
            total = 0
            while chunk := resp.read(1 << 20):
                total += len(chunk)
                if total > max_bytes:
                    raise ArtifactError(f"{url} is larger than {max_bytes} bytes")
                tmp.write(chunk)
        tmp.seek(0)
        with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
            tar.extractall(dest, filter="data")
    found = sorted(p.parent for p in dest.glob("*/*/manifest.json"))
    if not found:
        raise ArtifactError(f"{url} holds no <source>__<target>/<version>/manifest.json")
    for p in found:
        load(p)  # refuse a corrupt download here, not at serve time
    return found
