"""The vLLM connector's worker side: translations into vLLM's pages, and a producer's prompts out of them.

It lives in each vLLM worker, apart from the scheduler side (vllm_scheduler.py), and holds only worker state: the
sidecar client, the loads running (asynchronous, or this step's layer by layer), the blocks whose load failed, and
the K and V a producer's forward wrote for the prompts it publishes. It needs no vLLM import: the forward context and
the paged KV tensors are read by attribute and layout (importers.vllm_cpu_views).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kvferry.common.prefix import Namespace, block_hashes, model_key

from .connector_config import ConnectorConfig
from .importers import vllm_cpu_views
from .layer_load import LayerLoad, write_stream
from .vllm_connections import Connections
from .vllm_steps import Load, Steps

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
            progress = LayerLoad(len(layers), len(load.token_ids) - load.start)
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

    def _load(self, load: Load, layers: dict[int, torch.Tensor], progress: LayerLoad) -> None:
        if load.source is None:
            raise RuntimeError("vLLM allocated external tokens the scheduler side did not match")
        ns = Namespace(self.cfg.tenant, model_key(load.source.geometry, load.source.tokenizer))
        key = block_hashes(self._secret, ns, load.token_ids, self.cfg.prefix_block_size)[-1].hex()
        # Contiguous blocks, paged here: a paged answer is a message per page, which made a key-only hit 3x / 4x
        # slower than the same hit contiguous at 2048 / 8192 tokens in pages of 128 (vLLM's CPU default), 15x / 23x
        # in pages of 16 (its GPU default).
        stream = self.io.client.stream(
            None,
            self.cfg.map_name,
            load.version,
            token_ids=load.token_ids,
            prefix_key=key,
            tenant=self.cfg.tenant,
            source_geometry=load.source.geometry,
            tokenizer=load.source.tokenizer,
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

    # ---- publishing (a producer) ---------------------------------------------------------------
    def collect(self, steps: Steps, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy out of the layer's pages the K and V of each prompt this step publishes."""
        layer = layer_index(layer_name)
        if layer is None:
            return
        k_view, v_view = vllm_cpu_views(kv_layer)
        for save in steps.saves:
            n, blocks = len(save.token_ids), torch.tensor(save.block_ids)
            k = k_view[blocks].permute(1, 0, 2, 3).reshape(k_view.shape[1], -1, k_view.shape[3])[:, :n]  # [H, n, D]
            v = v_view[blocks].permute(1, 0, 2, 3).reshape(v_view.shape[1], -1, v_view.shape[3])[:, :n]
            self._collected.setdefault(save.req_id, (save, {}))[1][layer] = (k.clone(), v.clone())

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
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        self.io.close()
