"""The vLLM connector's worker side: translations into vLLM's pages, and a producer's prompts out of them.

It lives in each vLLM worker, apart from the scheduler side (vllm_scheduler.py), and holds only worker state: the
sidecar client, the loads running (asynchronous, or this step's layer by layer), the blocks whose load failed, the
K and V a producer's forward wrote for the prompts it publishes, and the live-quality comparisons: a load's
translated-but-not-loaded tail block (drift) or a shadow-sampled prompt's translation, against the K and V the
engine's forward wrote for the same tokens (``kv_drift``), handed to the scheduler side as samples. It needs no vLLM
import: the forward context and the paged KV tensors are read by attribute and layout (importers.vllm_cpu_views).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import torch

from kvferry.common.prefix import Namespace, block_hashes, model_key
from kvferry.mappings.drift import kv_drift

from .connector_config import ConnectorConfig
from .importers import read_pages, vllm_cpu_views
from .layer_load import LayerLoad, write_stream
from .vllm_connections import Connections
from .vllm_steps import Check, Load, MapSource, Sample, Steps

log = logging.getLogger("kvferry.vllm")
_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_index(layer_name: str) -> int | None:
    """The decoder layer a vLLM attention layer's name is in ("model.layers.3.self_attn.attn": 3), or None."""
    m = _LAYER.search(layer_name)
    return int(m.group(1)) if m else None


class ConnectorWorker:
    """``client``: a TranslateClient factory (called once, at the first load); ``store``: the prefix store's
    factory, likewise; ``model_path``: this engine's model folder (a producer reads its identity there)."""

    def __init__(self, cfg: ConnectorConfig, block_size: int, model_path: str, client, store):
        self.cfg, self.block_size, self.model_path = cfg, block_size, model_path
        self.io = Connections(client, store)
        self._secret = cfg.secret()
        self._identity = None  # a producer's ModelIdentity, read once
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()  # asynchronous loads fail on the loader thread
        self._loader: ThreadPoolExecutor | None = None  # the thread loads run on, off the engine's thread
        self._loading: dict[str, Future] = {}  # asynchronous loads, by request
        self._layer_by_layer = cfg.layer_by_layer  # off for good if the attention backend never waits for a layer
        self._step_loads: list[tuple[Load, LayerLoad, Future]] = []  # this step's loads, arriving layer by layer
        self._waited: set[int] = set()  # the layers this step's forward waited for
        self._waiting = 0.0  # seconds this step's forward spent waiting for them
        self._collected: dict[str, tuple[object, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}  # K, V by layer
        self._checker: ThreadPoolExecutor | None = None  # shadow checks' translations, off the engine and the loads
        self._quality_lock = threading.Lock()  # the loader and checker threads add to the two below
        self._aside: dict[str, dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}  # drift: mapped tail
        self._samples: list[Sample] = []  # comparisons done, for the scheduler side
        self._engine_kv: dict[str, tuple[Check, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}  # this step's

    # ---- loads ---------------------------------------------------------------------------------
    @staticmethod
    def attention_layers(forward_context) -> dict[int, torch.Tensor]:
        """Each decoder layer's paged KV tensor, from the forward context's attention layers."""
        out = {}
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            index = layer_index(name)
            if kv is None or index is None:
                continue
            out[index] = kv[0] if isinstance(kv, (list, tuple)) else kv
        return out

    def _loader_pool(self) -> ThreadPoolExecutor:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvferry-load")
        return self._loader

    def start_loads(self, steps: Steps, layers: dict[int, torch.Tensor]) -> None:
        for load in steps.loads:
            progress = LayerLoad(len(layers), len(load.token_ids) - load.check - load.start)
            if load.asynchronous:
                self._loading[load.req_id] = self._loader_pool().submit(self._load_or_report, load, layers, progress)
            elif self._layer_by_layer:  # the forward starts now; wait_for_layer holds each layer until it is in
                self._step_loads.append(
                    (load, progress, self._loader_pool().submit(self._load_or_report, load, layers, progress))
                )
            else:
                self._load_or_report(load, layers, progress)

    def _load_or_report(self, load: Load, layers: dict[int, torch.Tensor], progress: LayerLoad) -> None:
        try:
            self._load(load, layers, progress)
        except Exception as e:  # vLLM recomputes these blocks; the request goes on
            progress.fail(e)
            self._report(load, e)

    def _report(self, load: Load, error: Exception) -> None:
        """The load's blocks (those it was to fill) as load errors: vLLM recomputes them."""
        first, last = load.start // self.block_size, (len(load.token_ids) - 1) // self.block_size
        with self._errors_lock:
            self._load_errors.update(load.block_ids[first : last + 1])
        log.warning(
            "kvferry: translation for %s failed (%s); vLLM recomputes %d blocks", load.req_id, error, last - first + 1
        )

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load is over (in their pages, or its blocks reported as load errors)."""
        done = {r for r, f in self._loading.items() if f.done()}
        for r in done:
            del self._loading[r]
        return done

    def _translation(self, version: str, source: MapSource, token_ids: list[int]):
        """The sidecar's translation of ``token_ids`` (whole prefix blocks) by prefix key: a stream of contiguous
        blocks, each checked to come from an answer that covers them all."""
        ns = Namespace(self.cfg.tenant, model_key(source.geometry, source.tokenizer))
        key = block_hashes(self._secret, ns, token_ids, self.cfg.prefix_block_size)[-1].hex()
        # Contiguous blocks, paged here: a paged answer is a message per page, which made a key-only hit 3x / 4x
        # slower than the same hit contiguous at 2048 / 8192 tokens in pages of 128 (vLLM's CPU default), 15x / 23x
        # in pages of 16 (its GPU default).
        stream = self.io.client.stream(
            None,
            self.cfg.map_name,
            version,
            token_ids=token_ids,
            prefix_key=key,
            tenant=self.cfg.tenant,
            source_geometry=source.geometry,
            tokenizer=source.tokenizer,
        )

        def covering():
            for b in stream:
                if stream.info.num_tokens < len(token_ids):
                    raise RuntimeError(f"the sidecar translated {stream.info.num_tokens} of {len(token_ids)} tokens")
                yield b

        return stream, covering()

    def _load(self, load: Load, layers: dict[int, torch.Tensor], progress: LayerLoad) -> None:
        if load.source is None:
            raise RuntimeError("vLLM allocated external tokens the scheduler side did not match")
        stream, blocks = self._translation(load.version, load.source, load.token_ids)
        views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def view(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            if layer not in views:
                views[layer] = vllm_cpu_views(layers[layer])
            return views[layer]

        loaded = len(load.token_ids) - load.check

        def loaded_part():  # the tail block a drift check compares is set aside, never written into the pages
            for b in blocks:
                if b.end > loaded:
                    cut = max(b.start, loaded)
                    self._set_aside(load.req_id, b.layer, cut, b.key[:, cut - b.start :], b.value[:, cut - b.start :])
                    if b.start >= loaded:
                        continue
                    b = replace(b, end=loaded, key=b.key[:, : loaded - b.start], value=b.value[:, : loaded - b.start])
                yield b

        with stream:  # [kv_heads, tokens, head_dim], cut anywhere: each token into its page and slot as it arrives
            write_stream(loaded_part(), view, torch.as_tensor(load.block_ids), load.start, progress)

    def wait_for_layer(self, layer_name: str) -> None:
        if not self._step_loads:
            return
        layer = layer_index(layer_name)
        if layer is None:
            return
        self._waited.add(layer)
        t0 = time.perf_counter()
        for _, progress, _ in self._step_loads:
            if layer < progress.layers:
                progress.wait(layer, self.cfg.timeout)  # the call's own deadline ends the load sooner
        self._waiting += time.perf_counter() - t0

    def end_step(self) -> None:
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

    def load_errors(self) -> set[int]:
        self.end_step()  # (wait_for_save has joined them, unless vLLM deferred it)
        with self._errors_lock:
            out, self._load_errors = self._load_errors, set()
        return out

    # ---- live quality: drift and shadow comparisons --------------------------------------------
    def _set_aside(self, req_id: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with self._quality_lock:
            self._aside.setdefault(req_id, {}).setdefault(layer, []).append((start, k.clone(), v.clone()))

    def compare(self) -> None:
        """After the step's forward: each check collected this step against its translation (a drift check's set
        aside by its load; a shadow check's asked for now, on the checker thread). A check whose translation is
        missing (its load failed) gives no sample."""
        for req_id, (check, engine) in list(self._engine_kv.items()):
            del self._engine_kv[req_id]
            if check.signal == "drift":
                with self._quality_lock:
                    aside = self._aside.pop(req_id, None)
                if aside:
                    self._sample(check, aside, engine)
            else:
                if self._checker is None:
                    self._checker = ThreadPoolExecutor(1, thread_name_prefix="kvferry-check")
                self._checker.submit(self._shadow, check, engine)

    def _shadow(self, check: Check, engine) -> None:
        try:
            stream, blocks = self._translation(check.version, check.source, check.token_ids)
            mapped: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
            with stream:
                for b in blocks:
                    mapped.setdefault(b.layer, []).append((b.start, b.key.clone(), b.value.clone()))
            self._sample(check, mapped, engine)
        except Exception as e:  # a failed check is a missing sample, never a failed request
            log.warning("kvferry: shadow check of %s failed: %s", check.req_id, e)

    def _sample(self, check: Check, mapped, engine) -> None:
        """One comparison: ``mapped`` per layer the translation's (start, K, V) pieces, ``engine`` per layer the
        engine's K and V [kv_heads, tokens, head_dim] of the compared tokens."""
        start, n = check.start, len(check.token_ids) - check.start
        pairs = []
        for layer in sorted(engine):
            pieces = sorted(mapped.get(layer, []), key=lambda p: p[0])
            if not pieces:
                log.warning(
                    "kvferry: the translation for %s lacks layer %d; no %s sample", check.req_id, layer, check.signal
                )
                return
            first = pieces[0][0]
            if any(a[0] + a[1].shape[1] != b[0] for a, b in pairwise(pieces)) or first > start:
                log.warning("kvferry: the translation for %s has a gap; no %s sample", check.req_id, check.signal)
                return
            k = torch.cat([p[1] for p in pieces], 1)[:, start - first : start - first + n]
            v = torch.cat([p[2] for p in pieces], 1)[:, start - first : start - first + n]
            if k.shape[1] != n:
                log.warning(
                    "kvferry: the translation for %s misses compared tokens; no %s sample", check.req_id, check.signal
                )
                return
            tk, tv = engine[layer]
            pairs.append(((k[None], v[None]), (tk[None], tv[None])))
        if pairs:
            drift = kv_drift([m for m, _ in pairs], [t for _, t in pairs])
            with self._quality_lock:
                self._samples.append(Sample(check.version, check.signal, drift))

    def take_samples(self) -> list[Sample]:
        """The comparisons finished since the last call (for the scheduler side's quality monitor)."""
        with self._quality_lock:
            out, self._samples = self._samples, []
        return out

    def forget(self, req_ids: set[str]) -> None:
        """Finished requests: drop what their checks set aside."""
        with self._quality_lock:
            for r in req_ids:
                self._aside.pop(r, None)

    # ---- publishing (a producer), and the engine's side of the comparisons ------------------------
    def collect(self, steps: Steps, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy out of the layer's pages the K and V of each prompt this step publishes, and of each check's
        compared tokens."""
        layer = layer_index(layer_name)
        if layer is None:
            return
        k_view, v_view = vllm_cpu_views(kv_layer)
        for save in steps.saves:
            k, v = read_pages(k_view, v_view, save.block_ids, 0, len(save.token_ids))
            self._collected.setdefault(save.req_id, (save, {}))[1][layer] = (k, v)
        for check in steps.checks:
            k, v = read_pages(k_view, v_view, check.block_ids, check.start, len(check.token_ids))
            self._engine_kv.setdefault(check.req_id, (check, {}))[1][layer] = (k, v)

    def publish_collected(self) -> None:
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
            store=self.io.store,
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

    def shutdown(self) -> None:
        self.end_step()
        for pool in (self._loader, self._checker):
            if pool is not None:
                pool.shutdown(wait=True)
        self.io.close()
