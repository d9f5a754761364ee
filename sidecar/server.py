"""Assemble and run the sidecar: gRPC (aio) + health + reflection + metrics, reload and drain.

Health: service "" is SERVING while the process takes RPCs (liveness); "kvferry.v1.TranslateService"
is SERVING only once at least one servable map is loaded (readiness). Both go NOT_SERVING on drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kvferry.common import wire
from kvferry.common.channel import message_size_options
from kvferry.common.files import PEM_LIMIT, read_small_file
from kvferry.v1 import translate_pb2 as pb

from .compute import on_compute
from .config import SidecarConfig
from .interceptor import ErrorInterceptor
from .limits import by_key_decoder, request_decoder
from .metrics import Metrics
from .regions import RegionFolder
from .registry import MapRegistry
from .servicer import TranslateServicer

log = logging.getLogger("kvferry.sidecar")
SERVICE = pb.DESCRIPTOR.services_by_name["TranslateService"].full_name
PREFIX_STORE_SERVICE = "kvferry.v1.PrefixStore"
"""A health-only service name: SERVING while the shared prefix store is called, NOT_SERVING while its circuit is
open."""


def translate_handlers(servicer) -> grpc.GenericRpcHandler:
    """TranslateService's handlers, as the generated stub registers them, except that both translate methods' response
    serializer passes pre-encoded blocks through (see wire.encode_block_response), and their request deserializers
    refuse oversized headers unparsed (limits.request_decoder, limits.by_key_decoder)."""
    decode = request_decoder(servicer.limits, wire.decode_request)
    by_key = by_key_decoder(servicer.limits, pb.TranslateByKeyRequest.FromString)
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Translate": grpc.stream_stream_rpc_method_handler(
                servicer.Translate, request_deserializer=decode, response_serializer=wire.serialize
            ),
            "TranslateByKey": grpc.unary_stream_rpc_method_handler(
                servicer.TranslateByKey, request_deserializer=by_key, response_serializer=wire.serialize
            ),
            "ListMappings": grpc.unary_unary_rpc_method_handler(
                servicer.ListMappings,
                request_deserializer=pb.ListMappingsRequest.FromString,
                response_serializer=pb.ListMappingsResponse.SerializeToString,
            ),
        },
    )


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def enable_reflection(services: tuple[str, ...], server) -> None:
    """Server reflection as grpc.reflection.v1 (what grpcurl and current tools ask first) and v1alpha. grpcio-reflection
    ships only v1alpha; v1's messages are the same fields under a new package, so one servicer answers both.
    Reflection carries no comments: translate.proto is the contract's documentation."""
    names = (*services, REFLECTION_V1, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)  # public: reflection's __all__ exports aio
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                REFLECTION_V1,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            ),
        )
    )


def warm(ms, lanes=None) -> None:
    """One small translation through ``ms`` (zeros), so that kernel set-up, RoPE tables and weight casts happen
    before the sidecar reports SERVING rather than in the first caller's request: on every thread of ``lanes``."""
    import torch

    from kvferry.mappings.apply import apply

    g = ms.source.geometry
    zeros = torch.zeros(1, g.kv_heads, lanes.min_slice * lanes.parts if lanes else 32, g.head_dim)
    apply(ms, [(zeros, zeros) for _ in range(g.layers)], 0, lanes=lanes)


class Sidecar:
    """One running sidecar. ``await start()``, then ``await wait()``; ``await drain()`` to stop gracefully."""

    def __init__(self, config: SidecarConfig, extra_handlers: tuple = ()):
        self.config = config
        self.extra_handlers = extra_handlers  # more generic RPC handlers on the same server (benchmarks)
        self.metrics = Metrics()
        self.registry = MapRegistry(config.maps_dir, config.gates, config.force_maps, config.device)
        self.health = health.aio.HealthServicer()
        from .prefix_flow import PrefixService

        self.prefix = PrefixService(config, self.metrics) if config.prefix_cache else None
        self.authenticator = config.authenticator()
        self.regions = RegionFolder(config.shm_dir, self.metrics) if config.shm_dir else None
        self.servicer = TranslateServicer(
            self.registry,
            config.limits,
            self.metrics,
            config.max_streams,
            config.gate_arm,
            self.prefix,
            config.max_stream_seconds,
            config.resolved_map_threads(),
            self.regions,
        )
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.metrics_port = 0
        self.draining = False
        self._reload_task: asyncio.Task | None = None
        self.warmed: set[tuple[str, str]] = set()  # (map, version) already run once on the compute thread

    async def _watch_store(self) -> None:
        """Health service PREFIX_STORE_SERVICE follows the prefix store's circuit breaker: NOT_SERVING while the store
        is not called after a failure (streamed translations are served meanwhile; key-only ones get UNAVAILABLE)."""
        loop = asyncio.get_running_loop()
        status = health_pb2.HealthCheckResponse

        def changed(is_open: bool) -> None:  # on whichever thread called the store
            state = status.NOT_SERVING if is_open else status.SERVING
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.health.set(PREFIX_STORE_SERVICE, state)))

        self.prefix.on_breaker = changed
        await self.health.set(PREFIX_STORE_SERVICE, status.NOT_SERVING if self.prefix.skipping else status.SERVING)

    async def start(self) -> int:
        c = self.config
        if c.threads:
            import torch

            torch.set_num_threads(c.threads)
        self.server = grpc.aio.server(
            interceptors=[ErrorInterceptor(self.metrics, self.authenticator)],
            options=message_size_options(c.max_message_bytes),
        )
        self.server.add_generic_rpc_handlers((translate_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.extra_handlers:
            self.server.add_generic_rpc_handlers(self.extra_handlers)
        enable_reflection((SERVICE, health.SERVICE_NAME), self.server)
        address = f"{c.host}:{c.port}"
        if c.tls_cert:
            creds = grpc.ssl_server_credentials(
                [
                    (
                        read_small_file(c.tls_key, "tls_key", PEM_LIMIT),
                        read_small_file(c.tls_cert, "tls_cert", PEM_LIMIT),
                    )
                ],
                root_certificates=read_small_file(c.tls_client_ca, "tls_client_ca", PEM_LIMIT)
                if c.tls_client_ca
                else None,
                require_client_auth=bool(c.tls_client_ca),
            )
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness: the process serves RPCs
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)  # readiness: until maps load
        if self.prefix is not None and c.redis_url:
            await self._watch_store()
        await self.reload()
        await self.server.start()
        if c.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(c.host, c.metrics_port)
        if c.reload_seconds > 0:
            self._reload_task = asyncio.create_task(self._reload_loop())
        log.info(
            "kvferry sidecar on %s:%d (maps: %s, servable: %d)",
            c.host,
            self.port,
            c.maps_dir,
            self.registry.servable_count,
        )
        return self.port

    async def reload(self) -> list[str]:
        events = await self._scan()
        for ev in events:
            self.metrics.map_events.labels(ev.split(" ", 1)[0]).inc()
        self.metrics.record_maps(self.registry.entries(), self.config.gate_arm)
        await self._warm_new()
        if not self.draining:
            ok = self.registry.servable_count > 0
            await self.health.set(
                SERVICE, health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            )
        return events

    async def _scan(self) -> list[str]:
        """Loading maps builds tensors, so the scan runs on the compute thread like all of the sidecar's torch work."""
        return await on_compute(self.servicer.compute, self.registry.scan)

    async def _warm_new(self) -> None:
        """Warm each newly servable map on the compute thread (the thread that will run it) before readiness."""
        for e in self.registry.entries():
            key = (e.maps.name, e.maps.version)
            if e.servable and key not in self.warmed:
                try:
                    await on_compute(self.servicer.compute, warm, e.maps, self.servicer.compute.lanes)
                except Exception:  # a map that cannot warm up will fail its requests with a status
                    log.exception("warming map %s %s failed", *key)
                self.warmed.add(key)

    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reload_seconds)
            try:
                await self.reload()
            except Exception:  # a bad scan must never take the server down
                log.exception("map directory rescan failed; serving what is loaded")

    async def drain(self, grace: float | None = None) -> None:
        """NOT_SERVING at once; new RPCs are refused (UNAVAILABLE); in-flight streams get ``grace`` seconds."""
        if self.draining:
            return
        self.draining = True
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING, and it stays so
        if self._reload_task:
            self._reload_task.cancel()
        grace = self.config.drain_seconds if grace is None else grace
        notice = min(self.config.drain_notice_seconds, grace)
        await asyncio.sleep(notice)  # let probes and load balancers see NOT_SERVING
        if self.server:
            await self.server.stop(grace - notice)
        if self.regions is not None:
            self.regions.close()

    async def wait(self) -> None:
        if self.server:
            await self.server.wait_for_termination()


async def serve(config: SidecarConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    sidecar = Sidecar(config)
    await sidecar.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(sidecar.drain()))
    print(
        f"kvferry sidecar listening on {config.host}:{sidecar.port}"
        + (f", metrics on :{sidecar.metrics_port}" if sidecar.metrics_port else ""),
        flush=True,
    )
    await sidecar.wait()
