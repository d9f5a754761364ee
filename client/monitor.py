"""Live quality of a served map: the free drift signal, shadow checks, and the automatic switch-off.

Each mapped request may add a drift sample (mapped vs recomputed KV of the refreshed tail, no extra
model compute) and, for a sampled share, a shadow sample (next-token agreement and KL against the
target's own full prefill, computed off the critical path). vLLM's connector feeds the same monitor:
drift as K/V error only (vLLM does not hand a connector the queries), and its shadow share as the K/V
error of a whole prompt the engine prefilled itself (``observe_drift(..., signal="shadow")``: the
next-token scores of the path not taken cannot be computed inside the engine). When a rolling window's
mean crosses the map's gate, the monitor switches the map off in the policy store for new requests and
raises ``kvferry_rollout_auto_disabled``; requests in flight are unaffected.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch
from prometheus_client import Counter, Histogram

from kvferry.mappings.drift import Drift

from .rollout import MapRollout, PolicyStore

_COS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.97, 0.98, 0.99, 0.995, 1.0)
_ERR = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0)
_KL = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
DRIFT_COS = Histogram(
    "kvferry_client_drift_attn_cos",
    "Drift: attention-output cosine, mapped vs recomputed tail",
    ["map", "version"],
    buckets=_COS,
)
DRIFT_ERR = Histogram(
    "kvferry_client_drift_rel_error",
    "Drift: K/V relative error, mapped vs recomputed tail",
    ["map", "version"],
    buckets=_ERR,
)
SHADOW_ERR = Histogram(
    "kvferry_client_shadow_rel_error",
    "Shadow check (vLLM): K/V relative error of a whole prompt the engine prefilled itself",
    ["map", "version"],
    buckets=_ERR,
)
SHADOW_KL = Histogram(
    "kvferry_client_shadow_kl",
    "Shadow check: KL(full prefill || mapped path), next token",
    ["map", "version"],
    buckets=_KL,
)
SHADOW_TOP10 = Histogram(
    "kvferry_client_shadow_top10",
    "Shadow check: top-10 overlap with the full prefill",
    ["map", "version"],
    buckets=tuple(i / 10 for i in range(11)),
)
SHADOW_TOP1 = Counter(
    "kvferry_client_shadow_top1_agree_total", "Shadow checks whose top-1 token agreed", ["map", "version"]
)
TRIPS = Counter(
    "kvferry_rollout_auto_disable_total", "Times live monitoring switched a map off", ["map", "version", "signal"]
)


@dataclass(frozen=True)
class Thresholds:
    min_drift_attn_cos: float | None
    max_drift_rel_err: float | None
    min_shadow_top10: float | None
    max_shadow_kl: float | None

    @classmethod
    def resolve(cls, rollout: MapRollout, evidence) -> Thresholds:
        """Explicit policy values, else the map's evidence with margins, else no threshold for that signal."""
        ev = (
            {k: float(getattr(evidence, k, 0.0) or 0.0) for k in ("drift_attn_cos", "drift_rel_err", "top10", "kl")}
            if evidence is not None
            else {}
        )

        def pick(mine, derived):
            return mine if mine is not None else derived

        return cls(
            pick(rollout.min_drift_attn_cos, ev["drift_attn_cos"] - 0.05 if ev.get("drift_attn_cos") else None),
            pick(rollout.max_drift_rel_err, 1.25 * ev["drift_rel_err"] + 0.05 if ev.get("drift_rel_err") else None),
            pick(rollout.min_shadow_top10, ev["top10"] - 0.10 if ev.get("top10") else None),
            pick(rollout.max_shadow_kl, 3 * ev["kl"] + 0.02 if ev.get("top10") else None),
        )


def shadow_scores(full_logits: torch.Tensor, mapped_logits: torch.Tensor) -> tuple[bool, float, float]:
    """(top-1 agrees, top-10 overlap, KL(full || mapped)) of two next-token logit vectors."""
    lp_f, lp_m = full_logits.float().log_softmax(-1), mapped_logits.float().log_softmax(-1)
    a, b = set(full_logits.topk(10).indices.tolist()), set(mapped_logits.topk(10).indices.tolist())
    return (
        bool(full_logits.argmax() == mapped_logits.argmax()),
        len(a & b) / 10,
        float((lp_f.exp() * (lp_f - lp_m)).sum()),
    )


class QualityMonitor:
    """Rolling windows per (map, version); trips the policy store's switch when a window crosses its gate."""

    def __init__(self, store: PolicyStore):
        self.store = store
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str, str], collections.deque] = {}

    def _window(self, key: tuple[str, str, str], size: int) -> collections.deque:
        w = self._windows.get(key)
        if w is None or w.maxlen != size:
            w = self._windows[key] = collections.deque(w or (), maxlen=size)
        return w

    def _check(
        self,
        name: str,
        version: str,
        signal: str,
        value: float,
        limit: float | None,
        low_is_bad: bool,
        rollout: MapRollout,
    ) -> str:
        with self._lock:
            w = self._window((name, version, signal), rollout.window)
            w.append(value)
            if limit is None or len(w) < rollout.min_samples:
                return ""
            mean = sum(w) / len(w)
        crossed = mean < limit if low_is_bad else mean > limit
        if not crossed:
            return ""
        reason = (
            f"{signal} mean {mean:.4f} over the last {len(w)} requests is {'below' if low_is_bad else 'above'} "
            f"the gate {limit:.4f} (map {name} {version})"
        )
        TRIPS.labels(name, version, signal).inc()
        self.store.disable(name, reason)
        return reason

    def observe_drift(
        self, name: str, version: str, drift: Drift, thresholds: Thresholds, signal: str = "drift"
    ) -> str:
        """One K/V comparison: ``signal`` "drift" (the refreshed tail) or "shadow" (a whole prompt the target
        prefilled itself, vLLM's shadow sample); the attention cosine is checked when the drift has it."""
        rollout = self.store.get(name)
        cos = drift.mean_attn_cos
        if signal == "drift":
            DRIFT_ERR.labels(name, version).observe(drift.mean_rel_err)
            if cos is not None:
                DRIFT_COS.labels(name, version).observe(cos)
        else:
            SHADOW_ERR.labels(name, version).observe(drift.mean_rel_err)
        tripped = ""
        if cos is not None:
            tripped = self._check(
                name, version, f"{signal}_attn_cos", cos, thresholds.min_drift_attn_cos, True, rollout
            )
        return tripped or self._check(
            name, version, f"{signal}_rel_err", drift.mean_rel_err, thresholds.max_drift_rel_err, False, rollout
        )

    def observe_shadow(
        self, name: str, version: str, top1: bool, top10: float, kl: float, thresholds: Thresholds
    ) -> str:
        SHADOW_KL.labels(name, version).observe(kl)
        SHADOW_TOP10.labels(name, version).observe(top10)
        if top1:
            SHADOW_TOP1.labels(name, version).inc()
        rollout = self.store.get(name)
        return self._check(
            name, version, "shadow_top10", top10, thresholds.min_shadow_top10, True, rollout
        ) or self._check(name, version, "shadow_kl", kl, thresholds.max_shadow_kl, False, rollout)
