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

vLLM makes one connector per role. The scheduler's holds a ConnectorScheduler (vllm_scheduler.py: the rollout plan,
the store probe, the loads and publishes of each step); each worker's holds a ConnectorWorker (vllm_worker.py: the
loads into the pages, the publishes out of them). This class only adapts vLLM's hooks to them; each hook's docstring
says what vLLM expects of it and what kvferry does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvferry.common.errors import InvalidInput

from .connector_config import ConnectorConfig
from .vllm_scheduler import ConnectorScheduler
from .vllm_steps import Sample, Steps
from .vllm_worker import ConnectorWorker

log = logging.getLogger("kvferry.vllm")


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    """What the scheduler side hands the workers for one step (vllm_steps.Steps)."""

    steps: Steps


@dataclass
class QualitySamples(KVConnectorWorkerMetadata):
    """What the workers hand the scheduler side after a step: their drift and shadow comparisons."""

    samples: list[Sample]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return QualitySamples(self.samples + list(getattr(other, "samples", [])))


class KvferryConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        cfg = ConnectorConfig.from_extra(dict(transfer.kv_connector_extra_config or {}))
        block_size = vllm_config.cache_config.block_size
        if cfg.prefix_block_size % block_size:
            raise InvalidInput(
                f"kvferry connector: prefix_block_size {cfg.prefix_block_size} must be a multiple of "
                f"vLLM's block size {block_size}"
            )
        consumer, producer = transfer.is_kv_consumer, transfer.is_kv_producer
        if consumer and getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            # vLLM's default fails a request whose external KV did not load; kvferry's contract is that a failed
            # translation costs only the prefill it would have saved. The scheduler reads the policy after
            # creating its connector, so setting it here takes effect.
            try:
                transfer.kv_load_failure_policy = "recompute"
            except (AttributeError, TypeError, ValueError):
                raise InvalidInput(
                    "kvferry connector: set kv_transfer_config.kv_load_failure_policy = 'recompute' so that "
                    "a failed translation is recomputed instead of failing the request"
                ) from None
            log.info("kvferry: kv_load_failure_policy set to 'recompute' (a failed translation is recomputed by vLLM)")
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = ConnectorScheduler(
                cfg, block_size, consumer, producer, lambda: _client(cfg, None), lambda: _store(cfg)
            )
        else:
            self.worker = ConnectorWorker(
                cfg,
                block_size,
                vllm_config.model_config.model,
                lambda: _client(cfg, self.worker.io.store if cfg.direct_reads else None),
                lambda: _store(cfg),
            )

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM: how many tokens past ``num_computed_tokens`` this connector can load, and whether asynchronously
        (the request then waits, unscheduled, until get_finished reports it). Asked again on every step the request
        cannot yet be scheduled. kvferry: on a consumer, the request's rollout plan (PolicyStore.plan: kill switch,
        canary, minimum length, version, refresh) and, if it is on the mapped path, how many whole prefix blocks of
        the prompt before its refreshed tail the source engine has published (one store probe, kept for
        status_seconds)."""
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """vLLM: the request's blocks are allocated, ``num_external_tokens`` of them for this connector to fill
        (called again with 0 after an asynchronous load). kvferry: records the load (the plan's version and source,
        the tokens, and for an asynchronous load its blocks) for build_connector_meta."""
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """vLLM: this step's metadata for the workers, without changing ``scheduler_output``. kvferry: the loads
        recorded since the last step, and (a producer) the prompts whose prefill ends in this step, to publish."""
        return KvferryMetadata(self.scheduler.steps(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        """vLLM: the workers' output for a step (aggregated over workers). kvferry: their drift and shadow samples
        go into the quality monitor, which switches the map off for new requests when a window crosses its gate."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, QualitySamples) and meta.samples and self.scheduler.monitor is not None:
            self.scheduler.observe(meta.samples)

    def request_finished(self, request, block_ids):
        """vLLM: the request is done, before its blocks are freed; True would keep them for an asynchronous send.
        kvferry: forgets the request's scheduler state; publishing is synchronous (wait_for_save), so False."""
        self.scheduler.finished(request)
        return False, None

    # ---- worker side ---------------------------------------------------------------------------
    def _steps(self) -> Steps | None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta.steps if isinstance(meta, KvferryMetadata) else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM: whether this connector needs piecewise CUDA graphs (Python between layers). kvferry: yes when
        loads are layer by layer (wait_for_layer_load waits between attention layers, which a whole-model graph
        would skip), or when the settings cannot be read."""
        try:
            cfg = ConnectorConfig.from_extra(dict(extra_config or {}))
        except InvalidInput:
            return True
        return cfg.layer_by_layer and not cfg.async_loads

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """vLLM: before the step's forward, start loading this step's external KV into the paged buffers.
        kvferry: each load asks the sidecar for the prefix's translation by key and writes each token into its page
        and slot as blocks arrive: off the step for an asynchronous load, alongside the forward layer by layer, or
        whole before it returns."""
        steps = self._steps()
        if steps is None or not steps.loads:
            return
        self.worker.start_loads(steps, ConnectorWorker.attention_layers(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM: called inside each attention layer, before it reads its KV; block until that layer is loaded.
        kvferry: waits for this step's layer-by-layer loads to have written this layer's pages (returns at once
        otherwise: asynchronous loads are in before their request runs)."""
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """vLLM: called inside each attention layer after it wrote its KV; start saving it. kvferry: copies out of
        the layer's pages the K and V of each prompt this step publishes (a producer) and of each comparison's tokens
        (a consumer's drift and shadow checks)."""
        steps = self._steps()
        if steps is None or not (steps.saves or steps.checks):
            return
        self.worker.collect(steps, layer_name, kv_layer)

    def wait_for_save(self):
        """vLLM: once per step after the forward, metadata still bound; finish or hand off the saves. kvferry: joins
        this step's layer-by-layer loads, publishes each collected prompt's source KV to the prefix store (a failed
        publish is a later miss, never a failed request), and compares each check's K and V with its translation
        (a shadow check's translation is asked for off the engine's thread)."""
        self.worker.end_step()
        self.worker.publish_collected()
        self.worker.compare()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM: (requests whose asynchronous send finished, requests whose asynchronous load finished), given the
        requests finished since the last step. kvferry: sends are synchronous (None); the requests whose asynchronous
        load is over, in their pages or reported as load errors; what finished requests' checks set aside is
        dropped."""
        self.worker.forget(finished_req_ids)
        done = self.worker.finished_loads()
        return None, done or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """vLLM: after each step, this worker's metadata for the scheduler side (update_connector_output). kvferry:
        the drift and shadow comparisons finished since the last step."""
        samples = self.worker.take_samples()
        return QualitySamples(samples) if samples else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM: the blocks whose load failed, which it recomputes (kvferry sets kv_load_failure_policy to
        "recompute"). kvferry: the blocks of every failed translation, reported no later than the step its request
        is reported finished."""
        return self.worker.load_errors()

    def shutdown(self):
        """vLLM: the process is shutting down; complete or cancel what is running. kvferry: joins the loads and closes
        the sidecar client."""
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.close()


def _store(cfg: ConnectorConfig):
    from kvferry.common.stores import RedisStore

    return RedisStore(cfg.redis_url)


def _client(cfg: ConnectorConfig, direct_store):
    """The sidecar client of one side (``direct_store``: the worker's store, for direct reads of full hits)."""
    from .client import ClientOptions, Retry, SharedMemory, TranslateClient

    direct = None
    if direct_store is not None:
        from .direct import DirectReader

        direct = DirectReader(direct_store, cfg.secret(), cfg.prefix_block_size)
    return TranslateClient(
        ClientOptions(
            target=cfg.sidecar,
            timeout=cfg.timeout,
            auth_token=cfg.token(),
            retry=Retry(retries=1),
            shared_memory=SharedMemory(dir=cfg.shm_dir),
        ),
        direct=direct,
    )
