"""The map registry: versioned artifacts under one directory, reloaded without a restart.

Layout: ``<root>/<source>__<target>/<version>/{maps.safetensors,manifest.json}``. Each artifact
is verified on load (checksums, fingerprints, shapes) and gated on its evidence; a corrupt or
tampered artifact is refused with a log line and never replaces what already serves.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from kvferry.common.errors import GateFailed, KvferryError, NotFound
from kvferry.mappings.artifact import MapSet, check_name, load
from kvferry.mappings.gates import Gates
from kvferry.mappings.versions import check_version, serving_version, version_key

log = logging.getLogger("kvferry.registry")


@dataclass
class Entry:
    """One loaded artifact and whether it may serve."""

    path: Path
    maps: MapSet
    servable: bool
    reason: str  # why not servable ("" when it is)
    signature: tuple  # (mtime_ns, size) of both files when loaded


def _signature(path: Path) -> tuple:
    """(mtime_ns, size) of both files; refuses links and anything but regular files (a FIFO would block the scan)."""
    out = []
    for f in ("maps.safetensors", "manifest.json"):
        st = os.lstat(path / f)
        if not stat.S_ISREG(st.st_mode):
            raise KvferryError(f"{path / f} is not a regular file (links and special files are refused)")
        out += [st.st_mtime_ns, st.st_size]
    return tuple(out)


def _subdirs(path: Path) -> list[Path]:
    """Real subdirectories only: a symlink could lead out of the map directory."""
    return sorted(p for p in path.iterdir() if not p.name.startswith(".") and not p.is_symlink() and p.is_dir())


class MapRegistry:
    """Thread-safe view of the servable maps under ``root``."""

    def __init__(self, root: str | Path, gates: Gates | None = None, force: bool = False, device: str = "cpu"):
        self.root = Path(root)
        self.gates = gates or Gates()
        self.force = force
        self.device = device
        self._entries: dict[tuple[str, str], Entry] = {}
        self._bad: dict[Path, tuple] = {}  # path -> signature of an artifact already refused
        self._lock = threading.Lock()

    def scan(self) -> list[str]:
        """Load new or changed artifacts; returns one line per change (loaded, refused, removed)."""
        events = []
        seen = set()
        if not self.root.is_dir():
            return [f"map directory {self.root} does not exist"]
        for name_dir in _subdirs(self.root):
            for vdir in _subdirs(name_dir):
                key = (name_dir.name, vdir.name)
                try:
                    check_name(key[0]), check_version(key[1])
                    sig = _signature(vdir)
                except (KvferryError, OSError) as e:
                    if key in self._entries:  # a file went missing or was swapped: keep serving the loaded copy
                        seen.add(key)
                    if self._bad.get(vdir) != "invalid":
                        kept = " (the loaded copy keeps serving)" if key in self._entries else ""
                        events.append(f"refused {vdir}: {e}{kept}")
                        log.warning("refused map %s: %s%s", vdir, e, kept)
                        self._bad[vdir] = "invalid"
                    continue
                seen.add(key)
                current = self._entries.get(key)
                if (current and current.signature == sig) or self._bad.get(vdir) == sig:
                    continue
                try:
                    ms = load(vdir).to(self.device)
                    if ms.name != key[0] or ms.version != key[1]:
                        raise KvferryError(f"manifest says {ms.name} {ms.version} but it sits in {key[0]}/{key[1]}")
                    servable, problems = self.gates.verdict(ms.evidence, self.force)
                except Exception as e:  # one bad artifact (even a well-checksummed, malformed one) is refused alone
                    self._bad[vdir] = sig
                    reason = (
                        str(e)[:300]
                        if isinstance(e, KvferryError)
                        else f"malformed artifact ({type(e).__name__}: {str(e)[:200]})"
                    )
                    events.append(f"refused {vdir}: {reason}")
                    log.error("refused map %s (what is loaded keeps serving): %s", vdir, reason)
                    continue
                entry = Entry(vdir, ms, servable, "; ".join(problems), sig)
                with self._lock:
                    self._entries[key] = entry
                self._bad.pop(vdir, None)
                state = "servable" if servable else "gated off: " + entry.reason
                events.append(f"loaded {key[0]} {key[1]} ({state}{', forced' if problems and self.force else ''})")
                log.info("loaded map %s %s (%s)", key[0], key[1], state)
        with self._lock:
            for key in [k for k in self._entries if k not in seen]:
                del self._entries[key]
                events.append(f"removed {key[0]} {key[1]}")
                log.info("removed map %s %s (its version directory is gone)", *key)
        return events

    def entries(self, name_prefix: str = "") -> list[Entry]:
        with self._lock:
            items = [e for (n, _), e in self._entries.items() if n.startswith(name_prefix)]
        return sorted(items, key=lambda e: (e.maps.name, version_key(e.maps.version)))

    @property
    def servable_count(self) -> int:
        return sum(e.servable for e in self.entries())

    def resolve(self, name: str, version: str = "") -> MapSet:
        """The exact version, or (version "") the newest servable one."""
        with self._lock:
            versions = {v: e for (n, v), e in self._entries.items() if n == name}
        if not versions:
            known = sorted({n for n, _ in self._entries})
            raise NotFound(f"no map named {name!r}; this sidecar serves: {', '.join(known) or 'nothing yet'}")
        if version:
            entry = versions.get(version)
            if entry is None:
                raise NotFound(
                    f"map {name!r} has no version {version!r}; available: "
                    f"{', '.join(sorted(versions, key=version_key))}"
                )
            if not entry.servable:
                raise GateFailed(f"map {name} {version} is gated off: {entry.reason}")
            return entry.maps
        chosen = serving_version({v: e.servable for v, e in versions.items()})
        if chosen is None:
            raise GateFailed(
                f"no version of map {name!r} passes the serving gates: "
                + "; ".join(f"{v}: {e.reason}" for v, e in versions.items())
            )
        return versions[chosen].maps
