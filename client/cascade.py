"""The headline use: a source model reads a long prompt, the target reuses its cache via the sidecar.

``Cascade.generate`` translates the source cache, imports all but the last ``refresh`` tokens into
the target's HF cache, lets the target recompute the last ``refresh`` tokens on top, and decodes.
The rollout policy decides per request whether the mapped path is taken (``PolicyStore.plan``, the
decision every engine shares: kill switch, canary share, minimum prompt length, pinned version,
refresh); whenever it is not, or cannot be (sidecar unreachable, map gated off or unknown), the
target runs its own prefill and the result says why. Mapped requests feed live quality monitoring:
the drift of the refreshed tail (free) and, for a share, a shadow full prefill off the critical
path. A map whose live quality crosses its gate is switched off.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import Counter

from kvferry.mappings.cache import cache_layers
from kvferry.mappings.drift import Drift, QueryTap, tail_drift

from .attention import use_folded_gqa
from .client import TranslateClient, TranslateResult, serving_mapping
from .importers import to_dynamic_cache
from .monitor import QualityMonitor, Thresholds, shadow_scores
from .rollout import MapRollout, PolicyStore, Unresolved

log = logging.getLogger("kvferry.cascade")

FALLBACKS = Counter(
    "kvferry_client_fallbacks_total", "Requests that took the target's own prefill, by reason", ["reason"]
)
MAPPED = Counter("kvferry_client_mapped_total", "Requests served from a translated cache")
PATHS = Counter(
    "kvferry_client_requests_total", "Cascade requests by map, path taken and why", ["map", "path", "reason"]
)

_REASONS = {
    grpc.StatusCode.UNAVAILABLE: "sidecar_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "sidecar_timeout",
    grpc.StatusCode.FAILED_PRECONDITION: "map_gated_or_incompatible",
    grpc.StatusCode.NOT_FOUND: "map_not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "sidecar_overloaded",
}


@dataclass
class CascadeResult:
    tokens: list[int]
    path: str  # "mapped" or "fallback"
    reason: str  # why the path was taken
    ttft_seconds: float  # target time to first token (translate + import + refresh + first token, or full prefill)
    total_seconds: float
    translate: TranslateResult | None = None
    timings: dict = field(default_factory=dict)
    drift: Drift | None = None  # mapped vs recomputed tail, when the source cache covered the tail
    shadow: Future | None = None  # resolves to (top1, top10, kl) when this request was shadow-checked


def _rpc_reason(err: grpc.RpcError) -> str:
    """A fallback's reason for a failed sidecar call: its code word, the gRPC status and the details."""
    return f"{_REASONS.get(err.code(), 'sidecar_error')}: {err.code().name}: {err.details()}"


@torch.no_grad()
def _decode(model, first_logits: torch.Tensor, cache, max_new_tokens: int, eos: int | None) -> list[int]:
    tok = int(first_logits.argmax())
    out = [tok]
    while len(out) < max_new_tokens and tok != eos:
        logits = model(input_ids=torch.tensor([[tok]], device=model.device), past_key_values=cache).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
    return out


class Cascade:
    """``rollout``: a MapRollout for fixed controls, or a PolicyStore (a reloadable policy file) shared by engines.
    ``fold_gqa``: switch an ``sdpa`` target to kvferry_sdpa (attention.py: the same outputs, without copying the
    imported cache once per query head in the refresh and decode steps). Off by default: side by side on SmolLM2-135M
    it was not faster."""

    def __init__(
        self,
        target_model,
        client: TranslateClient | None,
        map_name: str,
        rollout: MapRollout | PolicyStore | None = None,
        source_identity=None,
        fold_gqa: bool = False,
    ):
        self.target = target_model
        if fold_gqa:
            use_folded_gqa(target_model)
        self.client = client
        self.map_name = map_name
        rollout = MapRollout() if rollout is None else rollout
        self.store = rollout if isinstance(rollout, PolicyStore) else PolicyStore.static(map_name, rollout)
        self.monitor = QualityMonitor(self.store)
        self.source_identity = source_identity
        self._shadow = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-shadow")
        self._evidence: dict[tuple[str, str], object] = {}
        from kvferry.mappings.geometry import geometry_of

        self._target_geometry = geometry_of(target_model.config)  # maps for another model are never used

    @torch.no_grad()
    def full_prefill(self, prompt_ids: torch.Tensor, max_new_tokens: int, reason: str = "baseline") -> CascadeResult:
        t0 = time.perf_counter()
        out = self.target(input_ids=prompt_ids, use_cache=True)
        ttft = time.perf_counter() - t0
        tokens = _decode(
            self.target, out.logits[0, -1], out.past_key_values, max_new_tokens, self.target.config.eos_token_id
        )
        return CascadeResult(tokens, "fallback", reason, ttft, time.perf_counter() - t0)

    def _fallback(self, prompt_ids, max_new_tokens, reason: str) -> CascadeResult:
        code = reason.split(":")[0]
        FALLBACKS.labels(code).inc()
        PATHS.labels(self.map_name, "fallback", code).inc()
        log.info("map %s: full prefill (%s)", self.map_name, reason)
        return self.full_prefill(prompt_ids, max_new_tokens, reason)

    def _latest(self) -> str:
        """The version the sidecar serves for "latest" (rollout.Unresolved when none, or when it cannot be asked)."""
        if self.client is None:
            raise Unresolved("no_sidecar: no client configured")
        try:
            listed = [m for m in self.client.list_mappings(self.map_name) if m.name == self.map_name]
        except grpc.RpcError as err:
            raise Unresolved(_rpc_reason(err)) from None
        chosen = serving_mapping(listed, self.map_name)
        if chosen is None:
            code = "map_gated_or_incompatible" if listed else "map_not_found"
            raise Unresolved(
                f"{code}: no servable version of {self.map_name} on the sidecar"
                + "".join(f"; {m.version}: {m.gate_reason}" for m in listed)
            )
        return chosen.version

    def _evidence_of(self, version: str):
        """The version's evidence as the sidecar lists it (kept once known); None when the map has none listed or the
        sidecar could not be asked (it is asked again next time)."""
        key = (self.map_name, version)
        if key not in self._evidence:
            try:
                found = [
                    m
                    for m in self.client.list_mappings(self.map_name)
                    if m.name == self.map_name and m.version == version
                ]
            except grpc.RpcError:
                return None
            self._evidence[key] = found[0].evidence if found else None
        return self._evidence[key]

    def _thresholds(self, version: str, rollout: MapRollout) -> Thresholds:
        return Thresholds.resolve(rollout, self._evidence_of(version))

    def measured_refresh(self, version: str) -> int:
        """The refresh ``version``'s evidence was measured with (0: none listed, or no sidecar to ask)."""
        if self.client is None:
            return 0
        ev = self._evidence_of(version)
        return int(ev.recommended_refresh) if ev is not None else 0

    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, source_kv, max_new_tokens: int = 32, request_id: str | None = None
    ) -> CascadeResult:
        """``source_kv``: the source's cache for the prompt: all n tokens (then the refreshed tail is also
        translated and feeds the drift signal), or at least the first n - refresh. ``request_id``: the engine's id
        of the request, which the canary and shadow draws are stable functions of (None: a fresh random one)."""
        name, n = self.map_name, prompt_ids.shape[1]
        t0 = time.perf_counter()
        plan = self.store.plan(name, request_id or uuid.uuid4().hex, n, self._latest, self.measured_refresh)
        if not plan.mapped:
            return self._fallback(prompt_ids, max_new_tokens, plan.reason)
        if self.client is None:  # a pinned version needs no resolving: the translation itself needs the sidecar
            return self._fallback(prompt_ids, max_new_tokens, "no_sidecar: no client configured")
        rollout, version, r = plan.rollout, plan.version, plan.refresh
        layers = cache_layers(source_kv)
        send = min(int(layers[0][0].shape[2]), n) if layers else 0
        if send < n - r:
            return self._fallback(prompt_ids, max_new_tokens, f"short_source_cache: {send} tokens < {n - r}")
        kw = {}
        if self.source_identity is not None:
            kw = dict(
                source_geometry=self.source_identity.geometry.fingerprint, tokenizer=self.source_identity.tokenizer
            )
        try:
            res = self.client.translate(
                [(k[:, :, :send], v[:, :, :send]) for k, v in layers],
                name,
                version,
                token_ids=prompt_ids[0, :send].tolist(),
                **kw,
            )
        except grpc.RpcError as err:
            return self._fallback(prompt_ids, max_new_tokens, _rpc_reason(err))
        except ConnectionError as err:
            return self._fallback(prompt_ids, max_new_tokens, f"sidecar_error: {err}")
        t1 = time.perf_counter()
        if res.info.geometry != self._target_geometry.fingerprint:
            return self._fallback(
                prompt_ids,
                max_new_tokens,
                f"map_incompatible: {name} {res.info.map_version} was fitted for "
                f"target geometry {res.info.geometry[:12]}…, this model is "
                f"{self._target_geometry.fingerprint[:12]}…",
            )
        mapped = res.layers()
        cache = to_dynamic_cache(
            [(k[:, :, : n - r], v[:, :, : n - r]) for k, v in mapped],
            self.target.config,
            device=self.target.device,
            dtype=self.target.dtype,
        )
        t2 = time.perf_counter()
        here = threading.get_ident()
        tap = (
            QueryTap(
                self.target, self._target_geometry.rope, lambda: threading.get_ident() == here
            )  # this thread's pass
            if send > n - r
            else None
        )
        try:
            logits = self.target(input_ids=prompt_ids[:, n - r :], past_key_values=cache).logits[0, -1]
            ttft = time.perf_counter() - t0
            drift = None
            if tap is not None:
                m = send - (n - r)
                true = [(k[:, :, n - r : send], v[:, :, n - r : send]) for k, v in cache_layers(cache)]
                drift = tail_drift(
                    [(k[:, :, n - r : send], v[:, :, n - r : send]) for k, v in mapped],
                    true,
                    [q[:, :m] for q in tap.queries(range(n - r, n))],
                )
        finally:
            if tap is not None:
                tap.close()
        thresholds = self._thresholds(res.info.map_version, rollout)
        if drift is not None:
            self.monitor.observe_drift(name, res.info.map_version, drift, thresholds)
        shadow = None
        if plan.shadow:
            shadow = self._shadow.submit(
                self._shadow_check, prompt_ids, logits.detach().clone(), res.info.map_version, thresholds
            )
        tokens = _decode(self.target, logits, cache, max_new_tokens, self.target.config.eos_token_id)
        MAPPED.inc()
        PATHS.labels(name, "mapped", "mapped").inc()
        return CascadeResult(
            tokens,
            "mapped",
            f"mapped {res.info.map_name} {res.info.map_version}, refresh r={r}",
            ttft,
            time.perf_counter() - t0,
            res,
            {"translate": t1 - t0, "import": t2 - t1, "refresh_first_token": ttft - (t2 - t0)},
            drift,
            shadow,
        )

    @torch.no_grad()
    def _shadow_check(
        self, prompt_ids, mapped_logits, version: str, thresholds: Thresholds
    ) -> tuple[bool, float, float]:
        """Off the critical path: the target's own full prefill, compared with what the mapped path produced."""
        full = self.target(input_ids=prompt_ids).logits[0, -1]
        top1, top10, kl = shadow_scores(full, mapped_logits)
        self.monitor.observe_shadow(self.map_name, version, top1, top10, kl, thresholds)
        return top1, top10, kl

    def close(self) -> None:
        self._shadow.shutdown(wait=True)
