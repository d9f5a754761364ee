"""Rollout controls: one policy, per map, reloadable without a restart.

Per map: a kill switch, the canary share of eligible requests that take the mapped path, the minimum
prompt length, the tail-refresh length, the version to serve ("latest" is resolved once per rollout
and pinned), the shadow-check share, and the live-quality window and thresholds. The policy is a TOML
file (a mounted ConfigMap)::

    [maps.S__T]
    enabled = true
    canary_percent = 10
    version = "1.1.0"        # or "latest"; rolling back is changing this line
    shadow_percent = 5

``PolicyStore`` re-reads it when it changes. A map the quality monitor switches off stays off until its
entry in the file changes (say, a rollback to the previous version) or ``reenable`` is called.

``PolicyStore.plan`` is the one rollout decision: every engine (the cascade, the vLLM connector) asks it whether a
request takes the mapped path and why, with which version and which refresh, and whether it is shadow-checked. Its
draws are stable functions of the request id, and "latest" is pinned once per policy generation, so the same request
under the same policy gets the same answer from every engine, and from one engine however often it asks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from prometheus_client import Gauge

from kvferry.common.errors import InvalidInput
from kvferry.mappings.versions import is_version

log = logging.getLogger("kvferry.rollout")

ENABLED = Gauge(
    "kvferry_rollout_enabled", "1 when the map may take the mapped path (kill switch on and not auto-disabled)", ["map"]
)
CANARY = Gauge("kvferry_rollout_canary_percent", "Share of eligible requests sent down the mapped path", ["map"])
AUTO_OFF = Gauge(
    "kvferry_rollout_auto_disabled", "1 while live quality monitoring holds the map off (alert on this)", ["map"]
)


def effective_refresh(configured: int, measured: int) -> int:
    """The prompt tokens the target recomputes on a mapped cache: the configured refresh, raised to the refresh the
    map's evidence was measured with (its recommended_refresh; 0: none recorded). The evidence, and so the gate that
    let the map serve, says nothing of a shorter refresh."""
    return max(configured, measured)


def draw(request_id: str, purpose: str) -> float:
    """A stable point in [0, 100) for one request and one purpose ("canary", "shadow"): a share p takes the requests
    whose draw is below p, so every engine, every time it asks, puts a request on the same side (sha256 of
    ``purpose:request_id``; the purposes are independent)."""
    digest = hashlib.sha256(f"{purpose}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100


class Unresolved(LookupError):
    """The version to serve could not be found: "latest" names nothing servable, or the sidecar could not be asked.
    Its message is the fallback's reason, "code: detail"."""


@dataclass(frozen=True)
class MapRollout:
    """How one map is rolled out. Thresholds left at None come from the map's evidence (its manifest)."""

    enabled: bool = True
    """Kill switch: False sends every request to the target's own prefill."""
    canary_percent: float = 100.0
    """Share (0-100) of eligible requests that take the mapped path; the rest run the target's own prefill."""
    min_tokens: int = 64
    """Prompts shorter than this take the target's own prefill (mapping would not pay)."""
    refresh: int = 16
    """r: the target recomputes the last r prompt tokens itself (and measures drift on them)."""
    version: str = "latest"
    """The map version to serve, or "latest": resolved to the newest servable version once, then pinned."""
    shadow_percent: float = 0.0
    """Share (0-100) of mapped requests that also run the target's full prefill off the critical path."""
    window: int = 50
    """Rolling window (samples) of each live-quality signal."""
    min_samples: int = 10
    """Samples a window needs before it can switch the map off."""
    min_drift_attn_cos: float | None = None
    """Switch off when the window's mean drift attention cosine falls below this (default: evidence - 0.05)."""
    max_drift_rel_err: float | None = None
    """Switch off when the window's mean drift K/V relative error rises above this (default: 1.25 x evidence + 0.05;
    vLLM's connector, which cannot see the queries, gates on this one)."""
    min_shadow_top10: float | None = None
    """Switch off when the window's mean shadow top-10 overlap falls below this (default: evidence - 0.10)."""
    max_shadow_kl: float | None = None
    """Switch off when the window's mean shadow KL rises above this (default: 3 x evidence + 0.02)."""

    def __post_init__(self) -> None:
        for name in ("canary_percent", "shadow_percent"):
            if not 0 <= getattr(self, name) <= 100:
                raise InvalidInput(f"{name} must be within 0-100, got {getattr(self, name)}")
        if self.refresh < 1:
            raise InvalidInput("refresh must be >= 1: the target computes at least the last prompt token")
        if self.min_tokens <= self.refresh:
            raise InvalidInput("min_tokens must exceed refresh")
        if self.version != "latest" and not is_version(self.version):
            raise InvalidInput(f"version {self.version!r}: use 'latest' or a semantic version such as 1.1.0")
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise InvalidInput("window must be >= 1 and min_samples within 1..window")


@dataclass(frozen=True)
class Plan:
    """One request's rollout decision (``PolicyStore.plan``)."""

    mapped: bool
    """Whether the request takes the mapped path."""
    reason: str
    """Why: "mapped <map> <version>, refresh r=<r>", or the fallback's "code: detail" (disabled, auto_disabled,
    short_prompt, canary_holdout, or what resolving the version gave)."""
    rollout: MapRollout
    """The policy entry the decision read (the quality monitor's thresholds come from it)."""
    version: str = ""
    """Mapped: the version to request (the policy's, or "latest" as pinned for this policy generation)."""
    refresh: int = 0
    """Mapped: the prompt tokens the target recomputes (``effective_refresh`` of the policy's and the evidence's)."""
    shadow: bool = False
    """Mapped: whether the request is also shadow-checked (its own stable draw against ``shadow_percent``)."""


@dataclass(frozen=True)
class RolloutPolicy:
    """Every map's rollout; maps not listed get ``default``."""

    maps: dict[str, MapRollout] = field(default_factory=dict)
    default: MapRollout = MapRollout()

    def get(self, name: str) -> MapRollout:
        return self.maps.get(name, self.default)

    @classmethod
    def from_toml(cls, text: str, where: str = "policy") -> RolloutPolicy:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise InvalidInput(f"{where}: not valid TOML ({e})") from None
        known = {f.name for f in fields(MapRollout)}

        def build(section: dict, label: str, base: MapRollout = MapRollout()) -> MapRollout:
            unknown = set(section) - known
            if unknown:
                raise InvalidInput(f"{where}: unknown keys in {label}: {', '.join(sorted(unknown))}")
            return replace(base, **section)

        default = build(data.get("default", {}), "[default]")
        maps = {name: build(sec, f"[maps.{name}]", default) for name, sec in data.get("maps", {}).items()}
        extra = set(data) - {"default", "maps"}
        if extra:
            raise InvalidInput(f"{where}: unknown sections {', '.join(sorted(extra))}; use [default] and [maps.<name>]")
        return cls(maps, default)


def to_toml(policy: RolloutPolicy) -> str:
    """The policy as TOML (only the fields that differ from their defaults), for ``kvferry rollout``."""

    def body(r: MapRollout, base: MapRollout) -> list[str]:
        out = []
        for f in fields(MapRollout):
            v = getattr(r, f.name)
            if v != getattr(base, f.name) and v is not None:
                out.append(
                    f"{f.name} = "
                    + ("true" if v is True else "false" if v is False else f'"{v}"' if isinstance(v, str) else repr(v))
                )
        return out

    lines = []
    if policy.default != MapRollout():
        lines += ["[default]", *body(policy.default, MapRollout()), ""]
    for name in sorted(policy.maps):
        lines += [f"[maps.{name}]", *body(policy.maps[name], policy.default), ""]
    return "\n".join(lines)


def update_policy_file(path: str | Path, name: str, **changes) -> MapRollout:
    """Change one map's entry in a policy file atomically (a rollback, a canary step, the kill switch)."""
    path = Path(path)
    policy = RolloutPolicy.from_toml(path.read_text(), str(path)) if path.exists() else RolloutPolicy()
    entry = replace(policy.get(name), **{k: v for k, v in changes.items() if v is not None})
    new = RolloutPolicy({**policy.maps, name: entry}, policy.default)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(to_toml(new))
    os.replace(tmp, path)
    return entry


class PolicyStore:
    """The live policy: re-read from ``path`` when the file changes (checked at most every ``reload_seconds``),
    plus the maps the quality monitor switched off and the versions "latest" resolved to."""

    def __init__(
        self, policy: RolloutPolicy | None = None, path: str | Path | None = None, reload_seconds: float = 2.0
    ):
        self.path = Path(path) if path else None
        self.reload_seconds = reload_seconds
        self._lock = threading.Lock()
        self._policy = policy or RolloutPolicy()
        self._stamp: tuple | None = None
        self._checked = 0.0
        self._auto_off: dict[str, str] = {}
        self._resolved: dict[str, str] = {}
        if self.path:
            self._reload(force=True)

    @classmethod
    def static(cls, name: str, rollout: MapRollout) -> PolicyStore:
        return cls(RolloutPolicy({name: rollout}))

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self.reload_seconds:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
        except OSError as e:
            if force:
                raise InvalidInput(f"cannot read rollout policy {self.path}: {e}") from None
            log.error("rollout policy %s unreadable (%s); keeping the last one", self.path, e)
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            new = RolloutPolicy.from_toml(self.path.read_text(), str(self.path))
        except InvalidInput as e:
            if force:
                raise
            log.error("rollout policy rejected, keeping the last good one: %s", e)
            self._stamp = stamp
            return
        self._apply(new)
        self._stamp = stamp

    def _apply(self, new: RolloutPolicy) -> None:
        old = self._policy
        for name in set(old.maps) | set(new.maps):
            if old.get(name) != new.get(name):
                log.info("rollout policy for %s: %s", name, new.get(name))
                self._resolved.pop(name, None)  # a changed entry is a new rollout: resolve "latest" again
                if self._auto_off.pop(name, None) is not None:
                    log.warning("rollout: %s re-enabled by a policy change", name)
                    AUTO_OFF.labels(name).set(0)
        self._policy = new

    def set_policy(self, policy: RolloutPolicy) -> None:
        """Replace the policy in process (tests, embedding code); a file, if any, still wins when it changes."""
        with self._lock:
            self._apply(policy)

    def get(self, name: str) -> MapRollout:
        with self._lock:
            if self.path:
                self._reload()
            r = self._policy.get(name)
            on = r.enabled and name not in self._auto_off
        ENABLED.labels(name).set(1 if on else 0)
        CANARY.labels(name).set(r.canary_percent)
        return r

    def off_reason(self, name: str) -> str:
        """Why the map may not take the mapped path now ("" if it may)."""
        r = self.get(name)
        with self._lock:
            if not r.enabled:
                return "disabled: kill switch in the rollout policy"
            if name in self._auto_off:
                return "auto_disabled: " + self._auto_off[name]
        return ""

    def disable(self, name: str, reason: str) -> None:
        """Switch a map off for new requests until re-enabled (the quality monitor calls this)."""
        with self._lock:
            if name in self._auto_off:
                return
            self._auto_off[name] = reason
        AUTO_OFF.labels(name).set(1)
        ENABLED.labels(name).set(0)
        log.error("rollout: %s switched off by live quality monitoring: %s", name, reason)

    def reenable(self, name: str) -> None:
        with self._lock:
            self._auto_off.pop(name, None)
            self._resolved.pop(name, None)
        AUTO_OFF.labels(name).set(0)
        log.warning("rollout: %s re-enabled by hand", name)

    def pinned_version(self, name: str, resolve) -> str:
        """The version to request: the policy's, or "latest" resolved once (``resolve()``) and pinned."""
        r = self.get(name)
        if r.version != "latest":
            return r.version
        with self._lock:
            if name in self._resolved:
                return self._resolved[name]
        version = resolve()
        with self._lock:
            self._resolved.setdefault(name, version)
            log.info("rollout: %s latest resolved to %s, pinned until the policy changes", name, version)
            return self._resolved[name]

    def plan(
        self,
        name: str,
        request_id: str,
        prompt_tokens: int,
        resolve: Callable[[], str],
        measured_refresh: Callable[[str], int],
    ) -> Plan:
        """Whether request ``request_id`` of ``prompt_tokens`` tokens takes map ``name``'s mapped path, and how.

        In order: the kill switch and the quality monitor's switch-off, ``min_tokens``, the canary draw, the version
        ("latest": ``resolve()``, once per policy generation; it raises Unresolved when nothing can serve), the
        refresh (the policy's, raised to ``measured_refresh(version)``, the evidence's), and a prompt longer than
        that refresh. The engine's own conditions (a source cache long enough, a target of the map's geometry) come
        after it."""
        r = self.get(name)
        off = self.off_reason(name)
        if off:
            return Plan(False, off, r)
        if prompt_tokens < r.min_tokens:
            return Plan(False, f"short_prompt: {prompt_tokens} < min_tokens {r.min_tokens}", r)
        if draw(request_id, "canary") >= r.canary_percent:
            return Plan(False, f"canary_holdout: outside the {r.canary_percent:g}% canary", r)
        try:
            version = self.pinned_version(name, resolve)
            refresh = effective_refresh(r.refresh, measured_refresh(version))
        except Unresolved as e:
            return Plan(False, str(e), r)
        if prompt_tokens <= refresh:
            return Plan(False, f"short_prompt: {prompt_tokens} tokens <= refresh r={refresh}", r)
        shadow = draw(request_id, "shadow") < r.shadow_percent
        return Plan(True, f"mapped {name} {version}, refresh r={refresh}", r, version, refresh, shadow)
