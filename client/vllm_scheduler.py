"""The vLLM connector's scheduler side: which requests load a translation, and which prompts are published.

It lives in vLLM's scheduler (the engine core), apart from the worker side (vllm_worker.py), and holds only
scheduler state: each request's rollout plan (``PolicyStore.plan``, the decision the cascade takes too), the
store's answer to how much of a prompt is published, the loads chosen but not yet handed to the workers, the
prompts of a producer that are still prefilling, the comparisons waiting for the engine to compute their tokens,
and the quality monitor (client/monitor.py, the cascade's) that the workers' samples feed:

- drift: a mapped request whose refreshed tail holds a whole published prefix block has that block translated with
  its load but not loaded; the engine computes it anyway, and the worker compares the two (K/V error; vLLM does not
  hand a connector the queries the cascade's attention cosine needs);
- shadow: a request the plan shadow-samples is served by the engine's own prefill, and the translation of its
  published prefix is compared with what that prefill wrote (a second prefill of one request beside it, the
  cascade's shadow, is not something a connector can run).

It needs no vLLM import: vLLM's request and scheduler-output objects are read by attribute, so it runs (and is
tested) without vLLM installed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvferry.common.prefix import Namespace, block_hashes, model_key

from .connector_config import ConnectorConfig
from .monitor import QualityMonitor, Thresholds
from .rollout import MapRollout, Plan, PolicyStore, Unresolved
from .vllm_connections import Connections
from .vllm_steps import Check, Load, MapSource, Sample, Save, Steps

log = logging.getLogger("kvferry.vllm")


@dataclass(frozen=True)
class Servable:
    """A map version the sidecar serves, as its ListMappings answer says."""

    version: str
    source: MapSource
    refresh: int
    """The refresh its evidence was measured with (0: none recorded)."""
    evidence: object = None
    """Its listed evidence (common.listing.Evidence): the quality monitor's default thresholds."""


def connector_policy(cfg: ConnectorConfig) -> PolicyStore:
    """The consumer's rollout policy: the policy file when one is configured, else the connector's own fields
    (map_version, "" meaning "latest"; min_tokens; refresh), as a one-map policy."""
    if cfg.policy_file:
        return PolicyStore(path=cfg.policy_file, reload_seconds=cfg.policy_reload_seconds)
    return PolicyStore.static(
        cfg.map_name, MapRollout(version=cfg.map_version or "latest", min_tokens=cfg.min_tokens, refresh=cfg.refresh)
    )


class ConnectorScheduler:
    """``client``: a TranslateClient factory (called once, when the sidecar is first asked); ``store``: the prefix
    store's factory, likewise."""

    def __init__(self, cfg: ConnectorConfig, block_size: int, consumer: bool, producer: bool, client, store):
        self.cfg, self.block_size, self.consumer, self.producer = cfg, block_size, consumer, producer
        self.io = Connections(client, store)
        self._secret = cfg.secret()
        self.policy = connector_policy(cfg) if consumer else None
        self.monitor = QualityMonitor(self.policy) if consumer else None
        self._servable: dict[str, tuple[float, Servable | None]] = {}  # version ("": latest) -> (when asked, answer)
        self._matched: dict[str, tuple[str, MapSource]] = {}  # request -> the version and source its tokens are from
        self._pending: dict[str, Load] = {}  # loads chosen this step, handed to the workers by steps()
        self._prefilling: dict[str, Save] = {}  # a producer's prompts whose prefill has not finished
        self._loaded_once: set[str] = set()  # requests given an asynchronous load already
        self._probed: dict[str, tuple[float, int]] = {}  # request -> (when, published blocks)
        self._shadows: dict[str, Check] = {}  # shadow-sampled requests not yet scheduled
        self._watched: dict[str, Check] = {}  # comparisons waiting for the engine to compute their last token

    # ---- the map and the rollout ---------------------------------------------------------------
    def servable(self, version: str) -> Servable | None:
        """What the sidecar serves for ``version`` ("": the newest servable), or None; from ListMappings, each answer
        (a failed call included) kept for status_seconds, so a sidecar outage costs one call per status_seconds."""
        seen = self._servable.get(version)
        if seen is not None and time.monotonic() - seen[0] < self.cfg.status_seconds:
            return seen[1]
        found = None
        try:
            from .client import serving_mapping

            chosen = serving_mapping(self.io.client.list_mappings(self.cfg.map_name), self.cfg.map_name, version)
            if chosen is not None:  # the version the sidecar will serve, not the first servable one listed
                found = Servable(
                    chosen.version,
                    MapSource(chosen.source.fingerprint, chosen.tokenizer_fingerprint),
                    int(chosen.evidence.recommended_refresh),
                    chosen.evidence,
                )
        except Exception as e:  # a sidecar outage means "no match", never a failed request
            log.warning("kvferry: sidecar %s unavailable (%s); requests prefill normally", self.cfg.sidecar, e)
        self._servable[version] = (time.monotonic(), found)
        if version == "" and found is not None:  # the same listing answers for the version "latest" resolved to
            self._servable[found.version] = self._servable[""]
        return found

    def _latest(self) -> str:
        found = self.servable("")
        if found is None:
            raise Unresolved(
                f"map_gated_or_incompatible: no servable version of {self.cfg.map_name} on the sidecar "
                "(or the sidecar could not be asked)"
            )
        return found.version

    def _measured(self, version: str) -> int:
        found = self.servable(version)
        return found.refresh if found is not None else 0

    def plan(self, request) -> Plan:
        """This request's rollout decision (``PolicyStore.plan``: the cascade's too, for the same request id)."""
        prompt = request.prompt_token_ids or []
        return self.policy.plan(self.cfg.map_name, str(request.request_id), len(prompt), self._latest, self._measured)

    # ---- vLLM's scheduler hooks (see the connector's docstrings) --------------------------------
    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.consumer or request.request_id in self._loaded_once:
            return 0, False  # a request back from an asynchronous load (failed, or preempted since) prefills itself
        plan = self.plan(request)
        if not plan.mapped:
            return 0, False
        found = self.servable(plan.version)
        if found is None:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        bs = self.cfg.prefix_block_size
        usable = (len(prompt) - plan.refresh) // bs  # whole prefix blocks before the refreshed tail
        if usable < 1:
            return 0, False
        checkable = len(prompt) // bs > usable  # a whole prefix block inside the tail: the drift sample
        ns = Namespace(self.cfg.tenant, model_key(found.source.geometry, found.source.tokenizer))
        blocks = self._published_blocks(request.request_id, ns, prompt[: (usable + checkable) * bs])
        if blocks is None or blocks < 1:
            return 0, False
        loaded = min(blocks, usable)
        if plan.shadow:  # the engine prefills it; its published prefix's translation is compared with that
            self._shadows[request.request_id] = Check(
                request.request_id, plan.version, "shadow", prompt[: loaded * bs], 0, source=found.source
            )
            return 0, False
        matched = max(0, loaded * bs - num_computed_tokens)
        if matched:
            self._matched[request.request_id] = (plan.version, found.source, bs if blocks > usable else 0)
        return matched, bool(matched and self.cfg.async_loads)

    def _published_blocks(self, req_id: str, ns: Namespace, prefix: list[int]) -> int | None:
        """How many leading prefix blocks of ``prefix`` are published (None: the store is unreachable). vLLM asks
        again for a request on every step it cannot yet schedule; the answer is kept for status_seconds, so a waiting
        request costs one store round trip, not one a step."""
        seen = self._probed.get(req_id)
        if seen is not None and time.monotonic() - seen[0] < self.cfg.status_seconds:
            return seen[1]
        hashes = block_hashes(self._secret, ns, prefix, self.cfg.prefix_block_size)
        try:
            present = self.io.store.exists_many([ns.key(h) for h in hashes])
        except Exception as e:
            log.warning("kvferry: prefix store unavailable (%s); prefilling normally", e)
            return None
        blocks = next((i for i, p in enumerate(present) if not p), len(present))
        self._probed[req_id] = (time.monotonic(), blocks)
        return blocks

    def allocated(self, request, blocks, num_external_tokens: int) -> None:
        """``blocks``: vLLM's KVCacheBlocks of the request (read only for an asynchronous load)."""
        self._probed.pop(request.request_id, None)
        if num_external_tokens <= 0:  # (called again with 0 once an asynchronous load is done: nothing to do then)
            return
        version, source, check = self._matched.pop(request.request_id, ("", None, 0))
        total = request.num_computed_tokens + num_external_tokens
        if total % self.cfg.prefix_block_size or total + check > len(request.prompt_token_ids):
            check = 0  # (vLLM loads what was matched: whole prefix blocks, so this does not happen)
        load = Load(
            request.request_id,
            version,
            source,  # None only if vLLM allocated tokens this side never matched: the worker reports a load error
            list(request.prompt_token_ids[: total + check]),
            [],
            request.num_computed_tokens,
            self.cfg.async_loads,
            check,
        )
        if check:
            self._watched[request.request_id] = Check(request.request_id, version, "drift", load.token_ids, total)
        if load.asynchronous:  # the request waits, unscheduled: its blocks are known now, not from the step
            load.block_ids = list(blocks.get_block_ids()[0])
            self._loaded_once.add(request.request_id)
        self._pending[request.request_id] = load

    def steps(self, scheduler_output) -> Steps:
        out = Steps()
        out.loads += [self._pending.pop(r) for r in [r for r, load in self._pending.items() if load.asynchronous]]
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                out.loads.append(load)
            elif self.producer and new.prompt_token_ids and len(new.prompt_token_ids) >= self.cfg.prefix_block_size:
                self._prefilling[new.req_id] = Save(new.req_id, list(new.prompt_token_ids), [])
            shadow = self._shadows.pop(new.req_id, None)
            if shadow is not None:
                self._watched[new.req_id] = shadow
            for waiting in self._waiting_on(new.req_id):
                waiting.block_ids = list(new.block_ids[0])
            self._step_done(
                out, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            )
        if self._prefilling or self._watched:  # chunked prefill: a prompt completes in a later step
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                if req_id in cached.resumed_req_ids:  # preempted and resumed: its blocks were replaced
                    self._prefilling.pop(req_id, None)
                    self._watched.pop(req_id, None)
                    continue
                for waiting in self._waiting_on(req_id):
                    if cached.new_block_ids[i]:
                        waiting.block_ids += list(cached.new_block_ids[i][0])
                self._step_done(
                    out, req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
                )
        self._pending.clear()
        return out

    def _waiting_on(self, req_id: str) -> list[Save | Check]:
        """The publish and the comparison of ``req_id`` that wait for the engine to compute their tokens."""
        return [w for w in (self._prefilling.get(req_id), self._watched.get(req_id)) if w is not None]

    def _step_done(self, out: Steps, req_id: str, computed_after_step: int) -> None:
        """What this step's forward completes for ``req_id``: publish once the whole prompt is in vLLM's cache (its
        whole prefix blocks, and the vLLM blocks that hold them); compare once the compared tokens are."""
        save = self._prefilling.get(req_id)
        if save is not None and computed_after_step >= len(save.token_ids):
            del self._prefilling[req_id]
            n = len(save.token_ids) // self.cfg.prefix_block_size * self.cfg.prefix_block_size
            out.saves.append(Save(req_id, save.token_ids[:n], save.block_ids[: n // self.block_size]))
        check = self._watched.get(req_id)
        if check is not None and computed_after_step >= len(check.token_ids):
            del self._watched[req_id]
            out.checks.append(check)

    def observe(self, samples: list[Sample]) -> None:
        """The workers' comparisons, into the quality monitor (which may switch the map off for new requests)."""
        for sample in samples:
            found = self.servable(sample.version)
            thresholds = Thresholds.resolve(self.policy.get(self.cfg.map_name), found and found.evidence)
            self.monitor.observe_drift(self.cfg.map_name, sample.version, sample.drift, thresholds, sample.signal)

    def finished(self, request) -> None:
        for state in (self._prefilling, self._matched, self._probed, self._shadows, self._watched):
            state.pop(request.request_id, None)
        self._loaded_once.discard(request.request_id)

    def close(self) -> None:
        self.io.close()
