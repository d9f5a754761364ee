"""kvferry as a vLLM KV connector (``KVConnectorBase_V1``), loaded by an unmodified vLLM::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.client.vllm_connector",
                           "kv_role": "kv_consumer",            # the target engine; "kv_producer" on the source
                           "kv_connector_extra_config": {"sidecar": "127.0.0.1:50551", "map_name": "S__T",
                                                         "redis_url": "redis://…", "prefix_secret": "…"}}'

Producer (the source engine): after a prompt's prefill, its source KV blocks go to the prefix store
(the same HMAC-keyed blocks as ``publish_source``). Consumer (the target engine): the scheduler asks
the store how many leading blocks of the prompt are published (a side-effect-free probe) and, if the
map is servable, reports them as matched tokens, minus the tail the target recomputes itself. The
worker then asks the sidecar to translate that prefix by key (contiguous: fewer, larger messages) and writes
each token into vLLM's paged KV cache (or, with ``direct_reads``, reads a full hit from the store itself); vLLM
computes only the uncovered tail. Each block is written into its pages as it arrives (client.stream). By default the
load is asynchronous: the request waits for its translation (vLLM's WAITING_FOR_REMOTE_KVS) while the engine keeps
stepping other requests, and ``get_finished`` reports it when the translation is in its pages. With ``async_loads``
off, the load runs inside the step that first schedules the request; with ``layer_by_layer`` too, the forward starts
at once and each attention layer waits for its own layer's pages only (``wait_for_layer_load``), so the first layers'
attention overlaps the arrival of later ones. If the translation fails, the blocks are reported as load errors and vLLM
recomputes them: a request never fails because of us.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvferry.common.errors import InvalidInput
from kvferry.common.prefix import Namespace, block_hashes, model_key

from .connector_config import ConnectorConfig
from .importers import vllm_cpu_views
from .layer_load import LayerLoad, write_stream
from .rollout import effective_refresh

log = logging.getLogger("kvferry.vllm")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class _Load:
    req_id: str
    version: str  # the map version the scheduler chose (policy pin or configured)
    token_ids: list[int]  # the prefix to translate (whole prefix blocks)
    block_ids: list[int]  # vLLM blocks of the request, in order
    start: int  # first token not already in vLLM's own cache
    asynchronous: bool = False  # loaded off the engine's step; reported by get_finished


@dataclass
class _Save:
    req_id: str
    token_ids: list[int]  # the prompt while prefilling; its whole prefix blocks once in the metadata
    block_ids: list[int]


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


class KvferryConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = ConnectorConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.block_size = vllm_config.cache_config.block_size
        if self.cfg.prefix_block_size % self.block_size:
            raise InvalidInput(
                f"kvferry connector: prefix_block_size {self.cfg.prefix_block_size} must be a multiple of "
                f"vLLM's block size {self.block_size}"
            )
        self.consumer = self._kv_transfer_config.is_kv_consumer
        self.producer = self._kv_transfer_config.is_kv_producer
        if self.consumer and getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            # vLLM's default fails a request whose external KV did not load; kvferry's contract is that a failed
            # translation costs only the prefill it would have saved. The scheduler reads the policy after
            # creating its connector, so setting it here takes effect.
            try:
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            except (AttributeError, TypeError, ValueError):
                raise InvalidInput(
                    "kvferry connector: set kv_transfer_config.kv_load_failure_policy = 'recompute' so that "
                    "a failed translation is recomputed instead of failing the request"
                ) from None
            log.info("kvferry: kv_load_failure_policy set to 'recompute' (a failed translation is recomputed by vLLM)")
        self.model_path = vllm_config.model_config.model
        self._secret = self.cfg.secret()
        self._store = None
        self._client = None
        self._identity = None  # producer: this engine's ModelIdentity, read once
        # (checked, source fingerprints, version, the refresh its evidence was measured with)
        self._status: tuple[float, tuple[str, str] | None, str, int] = (0.0, None, "", 0)
        self._policy = None
        if self.cfg.policy_file and self.consumer:
            from .rollout import PolicyStore

            self._policy = PolicyStore(path=self.cfg.policy_file, reload_seconds=self.cfg.policy_reload_seconds)
        self._pending: dict[str, _Load] = {}
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()  # asynchronous loads fail on the loader thread
        self._loader: ThreadPoolExecutor | None = None  # worker: the thread loads off the engine's thread run on
        self._loading: dict[str, Future] = {}
        self._layer_by_layer = self.cfg.layer_by_layer  # off for good if the attention backend never waits for a layer
        self._step_loads: list[tuple[_Load, LayerLoad, Future]] = []  # this step's loads, arriving layer by layer
        self._waited: set[int] = set()  # the layers this step's forward waited for
        self._waiting = 0.0  # seconds this step's forward spent waiting for them
        self._collected: dict[str, tuple[_Save, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}  # per layer K, V
        self._prefilling: dict[str, _Save] = {}  # scheduler side: prompts whose prefill has not finished
        self._loaded_once: set[str] = set()  # scheduler side: requests given an asynchronous load already
        self._probed: dict[str, tuple[float, int]] = {}  # scheduler side: request -> (when, published blocks)

    # ---- shared helpers ------------------------------------------------------------------------
    def store(self):
        if self._store is None:
            from kvferry.common.stores import RedisStore

            self._store = RedisStore(self.cfg.redis_url)
        return self._store

    def client(self):
        if self._client is None:
            from .client import ClientOptions, Retry, SharedMemory, TranslateClient

            direct = None
            if self.cfg.direct_reads:
                from .direct import DirectReader

                direct = DirectReader(self.store(), self._secret, self.cfg.prefix_block_size)
            self._client = TranslateClient(
                ClientOptions(
                    target=self.cfg.sidecar,
                    timeout=self.cfg.timeout,
                    auth_token=self.cfg.token(),
                    retry=Retry(retries=1),
                    shared_memory=SharedMemory(dir=self.cfg.shm_dir),
                ),
                direct=direct,
            )
        return self._client

    def _source(self, version: str) -> tuple[str, str] | None:
        """The map's source (geometry, tokenizer) fingerprints if ``version`` ("": any) is servable, else None;
        from ListMappings, cached for status_seconds."""
        checked, source, seen, _ = self._status
        if time.monotonic() - checked < self.cfg.status_seconds and seen == version:
            return source
        source, measured = None, 0
        try:
            from .client import serving_mapping

            chosen = serving_mapping(self.client().list_mappings(self.cfg.map_name), self.cfg.map_name, version)
            if chosen is not None:  # the version the sidecar will serve, not the first servable one listed
                source = (chosen.source.fingerprint, chosen.tokenizer_fingerprint)
                measured = int(chosen.evidence.recommended_refresh)
        except Exception as e:  # a sidecar outage means "no match", never a failed request
            log.warning("kvferry: sidecar %s unavailable (%s); requests prefill normally", self.cfg.sidecar, e)
        self._status = (time.monotonic(), source, version, measured)
        return source

    def _namespace(self, source: tuple[str, str]) -> Namespace:
        return Namespace(self.cfg.tenant, model_key(*source))

    def _rollout(self, request) -> tuple[str, int, int] | None:
        """(version, min_tokens, refresh) for this request, or None when the rollout policy keeps it off the
        mapped path (kill switch, automatic switch-off, outside the canary)."""
        if self._policy is None:
            return self.cfg.map_version, self.cfg.min_tokens, self.cfg.refresh
        name = self.cfg.map_name
        if self._policy.off_reason(name):
            return None
        r = self._policy.get(name)
        bucket = int.from_bytes(hashlib.sha256(str(request.request_id).encode()).digest()[:4], "little") % 10000
        if bucket >= r.canary_percent * 100:  # a stable per-request draw: the scheduler may ask more than once
            return None
        return (self.cfg.map_version if r.version == "latest" else r.version), r.min_tokens, r.refresh

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.consumer or request.request_id in self._loaded_once:
            return 0, False  # a request back from an asynchronous load (failed, or preempted since) prefills itself
        plan = self._rollout(request)
        if plan is None:
            return 0, False
        version, min_tokens, refresh = plan
        prompt = list(request.prompt_token_ids or [])
        n = len(prompt)
        if n < min_tokens:
            return 0, False
        source = self._source(version)
        if source is None:
            return 0, False
        ns = self._namespace(source)
        refresh = effective_refresh(refresh, self._status[3])  # never shorter than the map's evidence measured
        usable = (n - refresh) // self.cfg.prefix_block_size  # whole prefix blocks before the refreshed tail
        if usable < 1:
            return 0, False
        blocks = self._published_blocks(request.request_id, ns, prompt[: usable * self.cfg.prefix_block_size])
        if blocks is None:
            return 0, False
        matched = max(0, blocks * self.cfg.prefix_block_size - num_computed_tokens)
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
            present = self.store().exists_many([ns.key(h) for h in hashes])
        except Exception as e:
            log.warning("kvferry: prefix store unavailable (%s); prefilling normally", e)
            return None
        blocks = next((i for i, p in enumerate(present) if not p), len(present))
        self._probed[req_id] = (time.monotonic(), blocks)
        return blocks

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._probed.pop(request.request_id, None)
        if num_external_tokens > 0:  # (called again with 0 once an asynchronous load is done: nothing to do then)
            total = request.num_computed_tokens + num_external_tokens
            plan = self._rollout(request)  # the same draw as when the tokens were matched (stable per request)
            version = plan[0] if plan else self.cfg.map_version
            load = _Load(
                request.request_id,
                version,
                list(request.prompt_token_ids[:total]),
                [],
                request.num_computed_tokens,
                self.cfg.async_loads,
            )
            if load.asynchronous:  # the request waits, unscheduled: its blocks are known now, not from the step
                load.block_ids = list(blocks.get_block_ids()[0])
                self._loaded_once.add(request.request_id)
            self._pending[request.request_id] = load

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KvferryMetadata()
        meta.loads += [self._pending.pop(r) for r in [r for r, load in self._pending.items() if load.asynchronous]]
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
            elif self.producer and new.prompt_token_ids and len(new.prompt_token_ids) >= self.cfg.prefix_block_size:
                self._prefilling[new.req_id] = _Save(new.req_id, list(new.prompt_token_ids), list(new.block_ids[0]))
                self._maybe_save(
                    meta, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
                )
        if self.producer and self._prefilling:  # chunked prefill: a prompt completes in a later step
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                save = self._prefilling.get(req_id)
                if save is None:
                    continue
                if req_id in cached.resumed_req_ids:  # preempted and resumed: its blocks were replaced
                    self._prefilling.pop(req_id)
                    continue
                if cached.new_block_ids[i]:
                    save.block_ids += list(cached.new_block_ids[i][0])
                self._maybe_save(
                    meta, req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
                )
        self._pending.clear()
        return meta

    def _maybe_save(self, meta: KvferryMetadata, req_id: str, computed_after_step: int) -> None:
        """Publish once the whole prompt is in vLLM's cache (at the end of this step's forward): its whole prefix
        blocks, and the vLLM blocks that hold them."""
        save = self._prefilling[req_id]
        if computed_after_step >= len(save.token_ids):
            del self._prefilling[req_id]
            n = len(save.token_ids) // self.cfg.prefix_block_size * self.cfg.prefix_block_size
            meta.saves.append(_Save(req_id, save.token_ids[:n], save.block_ids[: n // self.block_size]))

    def request_finished(self, request, block_ids):
        self._prefilling.pop(request.request_id, None)
        self._loaded_once.discard(request.request_id)
        self._probed.pop(request.request_id, None)
        return False, None

    # ---- worker side ---------------------------------------------------------------------------
    def _attention_layers(self, forward_context) -> dict[int, torch.Tensor]:
        out = {}
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            m = _LAYER.search(name)
            if kv is None or m is None:
                continue
            out[int(m.group(1))] = kv[0] if isinstance(kv, (list, tuple)) else kv
        return out

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-by-layer loads wait between attention layers, which a whole-model CUDA graph would skip."""
        try:
            cfg = ConnectorConfig.from_extra(dict(extra_config or {}))
        except InvalidInput:
            return True
        return cfg.layer_by_layer and not cfg.async_loads

    def _loader_pool(self) -> ThreadPoolExecutor:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvferry-load")
        return self._loader

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvferryMetadata) or not meta.loads:
            return
        layers = self._attention_layers(forward_context)
        for load in meta.loads:
            progress = LayerLoad(len(layers), len(load.token_ids) - load.start)
            if load.asynchronous:
                self._loading[load.req_id] = self._loader_pool().submit(self._load_or_report, load, layers, progress)
            elif self._layer_by_layer:  # the forward starts now; wait_for_layer_load holds each layer until it is in
                self._step_loads.append(
                    (load, progress, self._loader_pool().submit(self._load_or_report, load, layers, progress))
                )
            else:
                self._load_or_report(load, layers, progress)

    def _load_or_report(self, load: _Load, layers: dict[int, torch.Tensor], progress: LayerLoad) -> None:
        try:
            self._load(load, layers, progress)
        except Exception as e:  # vLLM recomputes these blocks; the request goes on
            progress.fail(e)
            self._report(load, e)

    def _report(self, load: _Load, error: Exception) -> None:
        """The load's blocks (those it was to fill) as load errors: vLLM recomputes them."""
        first, last = load.start // self.block_size, (len(load.token_ids) - 1) // self.block_size
        with self._errors_lock:
            self._load_errors.update(load.block_ids[first : last + 1])
        log.warning(
            "kvferry: translation for %s failed (%s); vLLM recomputes %d blocks", load.req_id, error, last - first + 1
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous load is over (in their pages, or its blocks reported as load errors)."""
        done = {r for r, f in self._loading.items() if f.done()}
        for r in done:
            del self._loading[r]
        return None, done or None

    def _load(self, load: _Load, layers: dict[int, torch.Tensor], progress: LayerLoad) -> None:
        source = self._source(load.version)
        if source is None:
            raise RuntimeError("map not servable")
        key = block_hashes(self._secret, self._namespace(source), load.token_ids, self.cfg.prefix_block_size)[-1].hex()
        # Contiguous blocks, paged here: a paged answer is a message per page, which made a key-only hit 3x / 4x
        # slower than the same hit contiguous at 2048 / 8192 tokens in pages of 128 (vLLM's CPU default), 15x / 23x
        # in pages of 16 (its GPU default).
        stream = self.client().stream(
            None,
            self.cfg.map_name,
            load.version,
            token_ids=load.token_ids,
            prefix_key=key,
            tenant=self.cfg.tenant,
            source_geometry=source[0],
            tokenizer=source[1],
        )
        views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def view(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            if layer not in views:
                views[layer] = vllm_cpu_views(layers[layer])
            return views[layer]

        def covering():  # every block of an answer that covers the whole prefix
            for b in stream:
                if stream.info.num_tokens < len(load.token_ids):
                    raise RuntimeError(
                        f"the sidecar translated {stream.info.num_tokens} of {len(load.token_ids)} tokens"
                    )
                yield b

        with stream:  # [kv_heads, tokens, head_dim], cut anywhere: each token into its page and slot as it arrives
            write_stream(covering(), view, torch.as_tensor(load.block_ids), load.start, progress)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Hold this layer's attention until this step's loads have written its pages (returns at once without
        loads in the step: asynchronous ones are in before their request runs)."""
        if not self._step_loads:
            return
        m = _LAYER.search(layer_name)
        if m is None:
            return
        layer = int(m.group(1))
        self._waited.add(layer)
        t0 = time.perf_counter()
        for _, progress, _ in self._step_loads:
            if layer < progress.layers:
                progress.wait(layer, self.cfg.timeout)  # the call's own deadline ends the load sooner
        self._waiting += time.perf_counter() - t0

    def _end_step(self) -> None:
        """Join this step's layer-by-layer loads, so that none writes past the step. A load some of whose layers
        the forward never waited for (an attention backend that does not call wait_for_layer_load) may have been
        read before it arrived: it is reported as failed (vLLM drops the step's output for it and recomputes), and
        later loads are whole before the forward starts."""
        step, self._step_loads = self._step_loads, []
        waited, self._waited = self._waited, set()
        waiting, self._waiting = self._waiting, 0.0
        for load, progress, future in step:
            future.result()  # _load_or_report reports, never raises
            skipped = [layer for layer in range(progress.layers) if layer not in waited]
            if progress.error is None and not skipped:
                log.info(
                    "kvferry: %s loaded layer by layer: layer 0 in its pages after %.1f ms, all %d after %.1f ms; "
                    "the step's forward waited %.1f ms for its loads",
                    load.req_id,
                    progress.ready_at[0] * 1e3,
                    progress.layers,
                    max(progress.ready_at) * 1e3,
                    waiting * 1e3,
                )
            if progress.error is None and skipped:
                self._report(load, RuntimeError(f"the forward did not wait for layers {skipped}"))
                if self._layer_by_layer:
                    self._layer_by_layer = False
                    log.warning(
                        "kvferry: this attention backend does not call wait_for_layer_load; translations are "
                        "loaded whole before the step from now on"
                    )

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvferryMetadata) or not meta.saves:
            return
        m = _LAYER.search(layer_name)
        if m is None:
            return
        k_view, v_view = vllm_cpu_views(kv_layer)
        for save in meta.saves:
            n, blocks = len(save.token_ids), torch.tensor(save.block_ids)
            k = k_view[blocks].permute(1, 0, 2, 3).reshape(k_view.shape[1], -1, k_view.shape[3])[:, :n]  # [H, n, D]
            v = v_view[blocks].permute(1, 0, 2, 3).reshape(v_view.shape[1], -1, v_view.shape[3])[:, :n]
            self._collected.setdefault(save.req_id, (save, {}))[1][int(m.group(1))] = (k.clone(), v.clone())

    def wait_for_save(self):
        self._end_step()
        for req_id, (save, layers) in list(self._collected.items()):
            del self._collected[req_id]
            try:
                self._publish(save.token_ids, [layers[i] for i in sorted(layers)])
            except Exception as e:  # a failed publish is a future miss, never a failed request
                log.warning("kvferry: publishing %s failed: %s", req_id, e)

    def _publish(self, token_ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from kvferry.common.prefix_cache import publish_source

        key = publish_source(
            [(k[None], v[None]) for k, v in layers],
            token_ids,
            self._model_identity(),
            store=self.store(),
            secret=self._secret,
            tenant=self.cfg.tenant,
            block_size=self.cfg.prefix_block_size,
        )
        log.info("kvferry: published %d source tokens (prefix key %s…)", len(token_ids), key[:12])

    def _model_identity(self):
        if self._identity is None:
            from transformers import AutoConfig, AutoTokenizer

            from kvferry.mappings.geometry import ModelIdentity, geometry_of, tokenizer_fingerprint

            cfg = AutoConfig.from_pretrained(self.model_path)
            tok = AutoTokenizer.from_pretrained(self.model_path)
            self._identity = ModelIdentity(Path(self.model_path).name, geometry_of(cfg), tokenizer_fingerprint(tok), "")
        return self._identity

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._end_step()  # (wait_for_save has joined them, unless vLLM deferred it)
        with self._errors_lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        self._end_step()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._client is not None:
            self._client.close()
