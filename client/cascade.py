"""The headline use: a source model reads a long prompt, the target reuses its cache via the sidecar.

``Cascade.generate`` translates the source cache for all but the last ``refresh`` tokens, imports
it into the target's HF cache, lets the target recompute the last ``refresh`` tokens on top, and
decodes. Whenever the mapped path cannot be taken (sidecar unreachable, map gated off or unknown,
prompt too short), it runs the target's own prefill instead and says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import Counter

from kvferry.mappings.capture import cache_layers

from .client import TranslateClient, TranslateResult
from .importers import to_dynamic_cache

FALLBACKS = Counter("kvferry_client_fallbacks_total", "Requests that took the target's own prefill, by reason", ["reason"])
MAPPED = Counter("kvferry_client_mapped_total", "Requests served from a translated cache")

_REASONS = {
    grpc.StatusCode.UNAVAILABLE: "sidecar_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "sidecar_timeout",
    grpc.StatusCode.FAILED_PRECONDITION: "map_gated_or_incompatible",
    grpc.StatusCode.NOT_FOUND: "map_not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "sidecar_overloaded",
}


@dataclass(frozen=True)
class CascadePolicy:
    """When and how the target reuses a translated cache."""

    map_name: str
    """Map to use, "<source>__<target>"."""
    map_version: str = ""
    """Exact version, or "" for the newest servable one."""
    refresh: int = 16
    """r: the target recomputes the last r prompt tokens itself."""
    min_tokens: int = 64
    """Prompts shorter than this take the target's own prefill (mapping would not pay)."""

    def __post_init__(self) -> None:
        if self.refresh < 1:
            raise ValueError("refresh must be >= 1: the target computes at least the last prompt token")
        if self.min_tokens <= self.refresh:
            raise ValueError("min_tokens must exceed refresh")


@dataclass
class CascadeResult:
    tokens: list[int]
    path: str  # "mapped" or "fallback"
    reason: str  # why the path was taken
    ttft_seconds: float  # target time to first token (translate + import + refresh + first token, or full prefill)
    total_seconds: float
    translate: TranslateResult | None = None
    timings: dict = field(default_factory=dict)


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
    def __init__(self, target_model, client: TranslateClient | None, policy: CascadePolicy, source_identity=None):
        self.target = target_model
        self.client = client
        self.policy = policy
        self.source_identity = source_identity

    @torch.no_grad()
    def full_prefill(self, prompt_ids: torch.Tensor, max_new_tokens: int, reason: str = "baseline") -> CascadeResult:
        t0 = time.perf_counter()
        out = self.target(input_ids=prompt_ids, use_cache=True)
        ttft = time.perf_counter() - t0
        tokens = _decode(self.target, out.logits[0, -1], out.past_key_values, max_new_tokens, self.target.config.eos_token_id)
        return CascadeResult(tokens, "fallback", reason, ttft, time.perf_counter() - t0)

    def _fallback(self, prompt_ids, max_new_tokens, reason: str) -> CascadeResult:
        FALLBACKS.labels(reason.split(":")[0]).inc()
        return self.full_prefill(prompt_ids, max_new_tokens, reason)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, source_kv, max_new_tokens: int = 32) -> CascadeResult:
        """``source_kv``: the source's cache for (at least) the first n - refresh prompt tokens."""
        n, r = prompt_ids.shape[1], self.policy.refresh
        if n < self.policy.min_tokens:
            return self._fallback(prompt_ids, max_new_tokens, f"short_prompt: {n} < min_tokens {self.policy.min_tokens}")
        if self.client is None:
            return self._fallback(prompt_ids, max_new_tokens, "no_sidecar: no client configured")
        layers = [(k[:, :, : n - r], v[:, :, : n - r]) for k, v in cache_layers(source_kv)]
        kw = {}
        if self.source_identity is not None:
            kw = dict(source_geometry=self.source_identity.geometry.fingerprint, tokenizer=self.source_identity.tokenizer)
        t0 = time.perf_counter()
        try:
            res = self.client.translate(layers, self.policy.map_name, self.policy.map_version,
                                        token_ids=prompt_ids[0, : n - r].tolist(), **kw)
        except grpc.RpcError as err:
            reason = _REASONS.get(err.code(), "sidecar_error")
            return self._fallback(prompt_ids, max_new_tokens, f"{reason}: {err.code().name}: {err.details()}")
        except ConnectionError as err:
            return self._fallback(prompt_ids, max_new_tokens, f"sidecar_error: {err}")
        t1 = time.perf_counter()
        cache = to_dynamic_cache(res.layers(), self.target.config, device=self.target.device, dtype=self.target.dtype)
        t2 = time.perf_counter()
        logits = self.target(input_ids=prompt_ids[:, n - r :], past_key_values=cache).logits[0, -1]
        ttft = time.perf_counter() - t0
        tokens = _decode(self.target, logits, cache, max_new_tokens, self.target.config.eos_token_id)
        MAPPED.inc()
        return CascadeResult(tokens, "mapped", f"mapped {res.info.map_name} {res.info.map_version}, refresh r={r}", ttft,
                             time.perf_counter() - t0, res, {"translate": t1 - t0, "import": t2 - t1, "refresh_first_token": ttft - (t2 - t0)})
