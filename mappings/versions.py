"""Map versions: the one semantic-version parser, and the one rule for which version serves a request.

Every place that picks a version (the sidecar's registry, the direct reader, the cascade, the vLLM connector,
rollout policies) calls :func:`serving_version`, so a client never guesses differently from the sidecar.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .errors import ArtifactError

SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?")
"""MAJOR.MINOR.PATCH with an optional pre-release (1.2.0-rc.1); no leading zeros. Always fullmatch."""


def is_version(version: object) -> bool:
    return isinstance(version, str) and SEMVER.fullmatch(version) is not None


def check_version(version: str) -> str:
    if not is_version(version):
        raise ArtifactError(f"invalid map version {version!r}: use a semantic version such as 1.0.0")
    return version


def version_key(version: str) -> tuple:
    """Sort key: numeric MAJOR.MINOR.PATCH, and a pre-release before its release (1.2.0-rc.1 < 1.2.0)."""
    m = SEMVER.fullmatch(version) if isinstance(version, str) else None
    if m is None:
        raise ArtifactError(f"invalid map version {version!r}: use a semantic version such as 1.0.0")
    major, minor, patch, pre = m.groups()
    return (int(major), int(minor), int(patch), pre is None, pre or "")


def serving_version(servable: Mapping[str, bool], wanted: str = "") -> str | None:
    """The version a request for ``wanted`` gets, given each known version's servability: ``wanted`` itself when
    it is servable, or (``wanted`` empty) the newest servable version; None when nothing qualifies."""
    if wanted:
        return wanted if servable.get(wanted) else None
    ok = [v for v, s in servable.items() if s]
    return max(ok, key=version_key) if ok else None
