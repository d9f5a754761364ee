"""The gRPC servicer: adapts kvferry.v1 messages to the translation flow (flow.py) and the registry, and holds the
stream slots; the stream machinery (deadline, wake-ups, sending) is streams.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import weakref

from kvferry.common import wire
from kvferry.common.errors import InvalidInput, Overloaded, Unavailable
from kvferry.common.listing import mapping_to_pb
from kvferry.v1 import translate_pb2 as pb
from kvferry.v1 import translate_pb2_grpc as pb_grpc

from .auth import tenant_for
from .compute import ComputeThread
from .flow import TranslateFlow
from .limits import OversizedHeader, UndecodableRequest
from .streams import WAKE, Sender, before_deadline, no_chunks, with_wakes

CANCEL_NOTICE_SECONDS = 0.05
"""How long a stream that ended early waits for gRPC's cancel notice before it is refused as truncated. The notice
comes an event-loop turn after the end of stream; this is far more than that, and short enough that a caller that
really half-closed early gets its INVALID_ARGUMENT at once. Without the wait, a cancel would be counted as a
truncated stream (INVALID_ARGUMENT) instead of CANCELLED."""


class TranslateServicer(pb_grpc.TranslateServiceServicer):
    def __init__(
        self,
        registry,
        limits,
        metrics,
        max_streams: int,
        gate_arm: str = "mapped_refresh",
        prefix=None,
        max_stream_seconds: float = 300.0,
        map_threads: int = 1,
        regions=None,
    ):
        self.registry, self.limits, self.metrics = registry, limits, metrics
        self.regions = regions  # regions.RegionFolder, or None: response regions are ignored
        self.max_stream_seconds = max_stream_seconds
        self.prefix = prefix  # PrefixService or None
        self.max_streams, self.gate_arm = max_streams, gate_arm
        self.active = 0
        self.draining = False
        self.sessions: weakref.WeakSet = weakref.WeakSet()  # live request state (tests check none outlives its call)
        self.compute = ComputeThread(map_threads)  # all tensor work runs on this one thread (compute.py says why)
        self.flow = TranslateFlow(registry, limits, metrics, prefix, self.compute)

    async def ListMappings(self, request, context):
        return pb.ListMappingsResponse(
            mappings=[mapping_to_pb(e, self.gate_arm) for e in self.registry.entries(request.name_prefix)]
        )

    async def Translate(self, request_iterator, context):
        await self._serve(context, lambda deadline: self._translate(request_iterator, deadline))

    async def TranslateByKey(self, request, context):
        """A key-only Translate in one request message: the same answer as a Translate stream of its header alone."""
        await self._serve(context, lambda deadline: self._by_key(request))

    async def _serve(self, context, outputs) -> None:
        """Take a stream slot, send what ``outputs(deadline)`` yields, give the slot back."""
        if self.draining:
            raise Unavailable("this sidecar is draining (shutting down); retry on another endpoint")
        if self.active >= self.max_streams:
            raise Overloaded(
                f"{self.active} translate streams in flight, the limit is {self.max_streams}; "
                "retry after a short backoff (google.rpc.RetryInfo in the status details)",
                retry_after=0.1,
            )
        self.active += 1
        self.metrics.streams.inc()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_stream_seconds
        try:
            # aclosing: a stream that fails closes its generators at once, so their frames (which hold the request
            # messages) do not outlive the call.
            sender = Sender(context, deadline)
            try:
                async with contextlib.aclosing(outputs(deadline)) as outs:
                    async for out in outs:
                        await sender.send(out)
                await sender.drain()
            finally:
                await sender.settle()
        finally:
            self.active -= 1
            self.metrics.streams.dec()

    async def _translate(self, request_iterator, deadline: float):
        async with contextlib.aclosing(before_deadline(request_iterator, deadline)) as requests:
            first = await anext(requests, None)
            if first is None or isinstance(first, wire.ChunkFrame) or first.WhichOneof("msg") != "header":
                raise InvalidInput("a Translate stream must open with a header message")
            async for out in self._translate_stream(first.header, requests):
                yield out

    async def _by_key(self, request):
        if isinstance(request, (OversizedHeader, UndecodableRequest)):
            raise request.refuse()
        if not request.header.prefix_key:
            raise InvalidInput(
                "TranslateByKey needs header.prefix_key (the key publish_source returned) and token_ids; "
                "stream a request's source KV through Translate"
            )
        async for out in self._translate_stream(request.header, no_chunks()):
            yield out

    async def _translate_stream(self, header, requests):
        spec = dataclasses.replace(wire.spec_from_pb(header), tenant=tenant_for(header.tenant))
        opened = await self.flow.open(spec)
        session = opened.session
        self.sessions.add(session)
        region = self._region(spec)
        try:
            async for out in self._answer(spec, opened, requests, region):
                yield out
        finally:
            session.close()  # a failed or cancelled stream: its map work still queued is dropped
            if region is not None:
                region.close()  # waits for a write in flight on the compute thread: the fd is never reused under it

    def _region(self, spec):
        """The caller's response region, taken; None when it named none or it cannot be used (then the answer goes in
        the messages, and the response header says so)."""
        if not spec.response_region:
            return None
        if self.regions is None:
            self.metrics.response_regions.labels("ignored").inc()
            return None
        return self.regions.take(spec.response_region, spec.response_region_bytes, spec.response_region_key)

    async def _answer(self, spec, opened, requests, region):
        session = opened.session
        g = opened.ms.target.geometry
        info = session.info() if region is None else dataclasses.replace(session.info(), response_region=True)
        yield wire.info_to_pb(info, g.rope.rope_type, g.rope.theta)
        encode = (
            wire.encode_block_response
            if region is None
            else functools.partial(wire.encode_block_response, region=region)
        )
        for block in opened.initial:  # encoded as sent (numpy copies the data out: no torch parallel region)
            yield encode(block)
        wake = self.flow.wake_event(opened)
        # closed here, before the caller closes the request stream: its read-ahead must end first
        async with contextlib.aclosing(with_wakes(requests, wake)) as stream:
            async for req in stream:
                if req is WAKE:  # the map finished output between chunks: send it now, not at the next chunk
                    for encoded in await self.flow.poll(opened, encode):
                        yield encoded
                    continue
                if not isinstance(req, wire.ChunkFrame):  # the request decoder makes every chunk a frame
                    raise InvalidInput("after the header, a Translate stream carries only chunks")
                session.check_chunk_header(
                    req.layer, wire.chunk_kind(req), req.start, req.end
                )  # before the bytes are viewed
                chunk = wire.chunk_from_frame(req, session.expected_shape(req.end - req.start), spec.source_dtype)
                for encoded in await self.flow.add(opened, chunk, encode):
                    yield encoded
        try:
            last = await self.flow.drain(opened, encode)  # refuses a truncated stream first
            stats = self.flow.finish(opened)
        except InvalidInput:
            # A caller's cancel reaches the handler as a plain end of stream, one event-loop turn before gRPC's
            # own notice of it: wait a moment for that notice (it arrives here as CancelledError, counted
            # CANCELLED) before refusing the stream as truncated. A caller that really half-closed early gets its
            # INVALID_ARGUMENT this much later.
            await asyncio.sleep(CANCEL_NOTICE_SECONDS)
            raise
        for encoded in last:
            yield encoded
        yield wire.stats_to_pb(stats)
