"""The sidecar's use of the prefix store: reuse mapped blocks, map stored source blocks, write back.

Store outages never fail a request whose source KV arrives in the stream (a warning and a metric);
requests that name only a prefix key get UNAVAILABLE, since their data lives in the store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from kvferry.common.errors import InvalidInput, NotFound
from kvferry.common.prefix import Namespace, map_id, map_namespaces, model_id
from kvferry.common.prefix_cache import Lookup, PrefixCache
from kvferry.common.stores import StoreSkipped, StoreUnavailable, open_store
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import MapSet
from kvferry.sidecar.lanes import Lanes

from .compute import ComputeThread
from .pipeline import TranslateSession, start_session, target_dtype

log = logging.getLogger("kvferry.prefix")


@dataclass
class Plan:
    """What the store already holds for a streamed request, and where to write new blocks."""

    ns: Namespace
    lookup: Lookup


class PrefixService:
    def __init__(self, config, metrics):
        self.metrics = metrics
        self.timeout = config.prefix_store_timeout_seconds
        self.probe_seconds = config.prefix_probe_seconds
        self.on_breaker = None  # set by the server: the health service hears the breaker too
        self.store = open_store(
            config.redis_url,
            config.secret("redis_password") or None,
            config.prefix_memory_bytes,
            config.prefix_store_timeout_seconds,
            config.prefix_store_cooldown_seconds,
            self._breaker_changed,
        )
        key = config.secret("prefix_secret")
        secret = key.encode() if key else os.urandom(32)  # without a configured key: private to this process
        self.cache = PrefixCache(
            self.store, secret, config.prefix_block_size, config.prefix_ttl_seconds, config.prefix_max_blob_bytes
        )
        self.write_streamed = config.prefix_write_back  # may a caller's streamed KV become stored answers?

    @staticmethod
    def namespaces(ms: MapSet, tenant: str) -> tuple[Namespace, Namespace]:
        return map_namespaces(
            tenant, model_id(ms.source), model_id(ms.target), map_id(ms.name, ms.version, ms.content_sha256)
        )

    def _count(self, lookup: Lookup, wanted: int) -> None:
        self.metrics.prefix_blocks.labels("hit").inc(len(lookup.blocks))
        self.metrics.prefix_blocks.labels("miss").inc(max(0, wanted - len(lookup.blocks)))
        self.metrics.prefix_blocks.labels("corrupt").inc(lookup.corrupt)

    @property
    def skipping(self) -> bool:
        """Whether the store is skipped now (its circuit is open after a failure)."""
        return bool(getattr(self.store, "open", False))

    def _breaker_changed(self, is_open: bool) -> None:
        self.metrics.prefix_store_open.set(1 if is_open else 0)
        log.warning(
            "prefix store %s", "failing: not called for a while (circuit open)" if is_open else "answering again"
        )
        if self.on_breaker is not None:
            self.on_breaker(is_open)

    def _store_error(self, e: Exception) -> None:
        if isinstance(e, StoreSkipped):  # not called: the failure that opened the circuit was counted and logged
            return
        self.metrics.prefix_store_errors.inc()
        log.warning("prefix store unavailable, serving without it: %s", getattr(e, "detail", e))

    def consulted(self, spec) -> bool:
        """Whether a streamed request reads the store: it has token ids from position 0, the store is not skipped
        (its circuit is closed), and streamed requests may wait on it at all (prefix_probe_seconds > 0)."""
        return bool(spec.token_ids) and spec.start_position == 0 and self.probe_seconds > 0 and not self.skipping

    def probe(self, spec, ms: MapSet) -> int | None:
        """How many leading target blocks of a streamed request are stored (one EXISTS round trip; None when the
        store is unavailable)."""
        _, tgt_ns = self.namespaces(ms, spec.tenant)
        keys = [tgt_ns.key(h) for h in self.cache.hashes(tgt_ns, spec.token_ids)]
        if not keys:
            return 0
        try:
            present = self.store.exists_many(keys)
        except StoreUnavailable as e:
            self._store_error(e)
            return None
        return next((i for i, p in enumerate(present) if not p), len(present))

    def plan(self, spec, ms: MapSet, stored: int | None = None) -> Plan | None:
        """For a streamed request with token ids: the stored target blocks of its longest prefix, and where new ones
        would be written. ``stored``: the probe's count, when it ran (0: nothing is read, the plan only says where
        to write)."""
        if not spec.token_ids or spec.start_position != 0:
            return None
        _, tgt_ns = self.namespaces(ms, spec.tenant)
        tg = ms.target.geometry
        dtype = target_dtype(spec, ms)
        try:
            if stored == 0:
                look = Lookup(self.cache.hashes(tgt_ns, spec.token_ids), 0, [], 0, dtype)
            else:
                look = self.cache.lookup(
                    tgt_ns, spec.token_ids, tg.layers, tg.kv_heads, tg.head_dim, dtype=dtype, stored_dtype=ms.dtype
                )
        except StoreUnavailable as e:
            self._store_error(e)
            return None
        self._count(look, len(look.hashes))
        return Plan(tgt_ns, look)

    def write_back(self, plan: Plan, session: TranslateSession, compute: ComputeThread) -> int:
        """Store the newly mapped full blocks of a finished streamed request (off the critical path); returns blocks
        written. Runs on an I/O thread: joining and encoding the session's kept target KV runs on ``compute``."""
        look = plan.lookup
        if len(look.hashes) <= look.end_block or not session.outputs:
            return 0
        if session.out_dtype.itemsize < session.ms.dtype.itemsize:
            return 0  # stored blocks hold the map's own precision: a narrower answer cannot give it back
        items = compute.submit(_encode_outputs, self.cache, plan, session).result()
        return self._put(items)

    def _put(self, items: list[tuple[str, bytes]]) -> int:
        try:
            n = self.cache.put(items)
        except StoreUnavailable as e:
            self._store_error(e)
            return 0
        self.metrics.prefix_writes.inc(n)
        return n

    def from_store(self, spec, ms: MapSet, limits, compute: ComputeThread) -> tuple[TranslateSession, list, int]:
        """A key-only request: stored target blocks, then stored source blocks mapped now and written back. Runs on an
        I/O thread; the mapping itself runs on ``compute`` (the sidecar's one compute thread).

        Returns a session, its initial blocks (the whole answer), and how many blocks were cached.
        Raises Unavailable when the store is down, NotFound when nothing is stored for the key.
        """
        if not spec.token_ids:
            raise InvalidInput("a prefix_key request needs token_ids: the sidecar derives the target's keys from them")
        if spec.start_position != 0:
            raise InvalidInput("prefix caching covers prompts from position 0; start_position must be 0")
        src_ns, tgt_ns = self.namespaces(ms, spec.tenant)
        sg, tg = ms.source.geometry, ms.target.geometry
        src_hashes = self.cache.hashes(src_ns, spec.token_ids)
        tips = [h.hex() for h in src_hashes]
        if spec.prefix_key not in tips:
            raise NotFound(
                "prefix_key does not name a full-block prefix of these token_ids for this tenant and source "
                "model; use the key publish_source returned for the same tokens"
            )
        blocks = tips.index(spec.prefix_key) + 1
        bs = self.cache.block_size
        tokens = list(spec.token_ids[: blocks * bs])
        dtype = target_dtype(spec, ms)
        tgt = self.cache.lookup(tgt_ns, tokens, tg.layers, tg.kv_heads, tg.head_dim, dtype=dtype, stored_dtype=ms.dtype)
        self._count(tgt, blocks)
        # a windowed map also reads the source tokens just before the first it maps: fetch their blocks too
        context = min(ms.context, tgt.end_block * bs)
        context_blocks = -(-context // bs)
        # the source blocks as their publisher stored them: a caller's source_dtype (what its own KV would be) never
        # changes what is mapped, and so what is stored for every later caller
        src = self.cache.lookup(
            src_ns,
            tokens,
            sg.layers,
            sg.kv_heads,
            sg.head_dim,
            start_block=tgt.end_block - context_blocks,
            hashes=src_hashes[:blocks],
        )
        covered = tgt.end_block + max(0, len(src.blocks) - context_blocks)
        if covered == 0:
            raise NotFound("no stored blocks for this prefix_key (expired, evicted, or never published)")
        cached = tgt  # all stored: sent from the blobs' bytes
        if covered > tgt.end_block:
            cached, items = compute.submit(
                _map_stored,
                self.cache,
                ms,
                src,
                tgt,
                tgt_ns,
                context_blocks * bs - context,
                covered,
                dtype,
                context,
                compute.lanes,
            ).result()
            self._put(items)
        spec2 = dataclasses.replace(spec, num_tokens=covered * bs, token_ids=tuple(tokens[: covered * bs]))
        return (*compute.submit(start_session, spec2, ms, limits, cached, False).result(), tgt.end_block)


# The functions below touch tensor data, so they run on the compute thread (compute.py).


def _map_stored(
    cache: PrefixCache,
    ms: MapSet,
    src: Lookup,
    tgt: Lookup,
    tgt_ns: Namespace,
    drop: int,
    covered: int,
    dtype: torch.dtype,
    context: int,
    lanes: Lanes | None,
):
    """Map the stored source blocks past the stored target ones: (the target KV of every covered token, the mapped
    blocks encoded for the store)."""
    bs = cache.block_size
    layers = [(k[:, :, drop:], v[:, :, drop:]) for k, v in src.layers()]
    out = apply(ms, layers, tgt.end_block * bs, context, lanes)
    # stored at the map's own precision, whatever this caller asked for: a later caller reads what it would compute
    kept = [(k.to(ms.dtype), v.to(ms.dtype)) for k, v in out]
    items = cache.encode_blocks(tgt_ns, tgt.hashes, kept, tgt.end_block, covered, token_offset=tgt.end_block * bs)
    mapped = [(k.to(dtype), v.to(dtype)) for k, v in out]
    stored = tgt.layers()
    joined = (
        mapped
        if not stored
        else [(torch.cat([a, c], 2), torch.cat([b, d], 2)) for (a, b), (c, d) in zip(stored, mapped)]
    )
    return joined, items


def _encode_outputs(cache: PrefixCache, plan: Plan, session: TranslateSession) -> list[tuple[str, bytes]]:
    look, dt = plan.lookup, session.ms.dtype
    layers = [(k.to(dt), v.to(dt)) for k, v in session.output_layers()]
    return cache.encode_blocks(plan.ns, look.hashes, layers, look.end_block, len(look.hashes))
