"""The gRPC servicer: adapts kvferry.v1 messages to the translation flow (flow.py) and the registry; stream slots,
deadlines and sending are its only concerns."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import weakref

from kvferry.common import wire
from kvferry.common.errors import CallerGone, InvalidInput, Overloaded, Unavailable
from kvferry.v1 import translate_pb2 as pb
from kvferry.v1 import translate_pb2_grpc as pb_grpc

from .auth import tenant_for
from .compute import ComputeThread
from .flow import TranslateFlow
from .limits import OversizedHeader, UndecodableRequest

CANCEL_NOTICE_SECONDS = 0.05
"""How long a stream that ended early waits for gRPC's cancel notice before it is refused as truncated (the notice
was measured at ~0.1 ms after the end of stream, across processes on loopback)."""


def _geometry(g) -> pb.Geometry:
    return pb.Geometry(
        architecture=g.architecture,
        layers=g.layers,
        kv_heads=g.kv_heads,
        head_dim=g.head_dim,
        fingerprint=g.fingerprint,
        rope_type=g.rope.rope_type,
        rope_theta=g.rope.theta,
    )


def mapping_info(entry, arm: str) -> pb.MappingInfo:
    ms = entry.maps
    ev = (ms.evidence or {}).get("arms", {}).get(arm, {})
    return pb.MappingInfo(
        name=ms.name,
        version=ms.version,
        source=_geometry(ms.source.geometry),
        target=_geometry(ms.target.geometry),
        tokenizer_fingerprint=ms.source.tokenizer,
        content_sha256=ms.content_sha256,
        servable=entry.servable,
        gate_reason=entry.reason,
        context_tokens=ms.context,
        dtype=wire.dtype_to_pb(ms.dtype),
        evidence=pb.MapEvidence(
            arm=arm,
            top1=ev.get("top1", 0.0),
            top10=ev.get("top10", 0.0),
            kl=ev.get("kl", 0.0),
            attn_cos=ev.get("attn_cos", 0.0),
            drift_attn_cos=ev.get("drift_attn_cos", 0.0),
            drift_rel_err=ev.get("drift_rel_err", 0.0),
            recommended_refresh=int((ms.evidence or {}).get("recommended_refresh", 0)),
        ),
    )


async def _before(requests, deadline: float):
    """The request stream, cut off at ``deadline`` (loop time): a stalled client cannot hold a stream slot forever."""
    loop = asyncio.get_running_loop()
    it = aiter(requests)
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(
                "the Translate stream ran past the sidecar's max_stream_seconds; send faster or split the prompt"
            )
        try:
            # asyncio.timeout, not wait_for: the read runs in the handler's own task (no task per message), so a
            # caller's cancel reaches the handler as a cancellation more often than as a plain end of stream.
            async with asyncio.timeout(remaining):
                msg = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise TimeoutError("no request message arrived before the sidecar's max_stream_seconds ran out") from None
        if isinstance(msg, OversizedHeader):
            raise msg.refuse()
        yield msg


WAKE, _END = object(), object()


async def _with_wakes(requests, wake: asyncio.Event | None):
    """The requests, with WAKE in between whenever ``wake`` is set: a map running on lanes finished output while the
    stream waited for the caller's next message (a caller may wait for the first target layer before sending the
    rest). The next request is read while the current one is handled."""
    if wake is None:
        async for req in requests:
            yield req
        return
    reader = asyncio.ensure_future(anext(requests, _END))
    try:
        while True:
            if not reader.done() and not wake.is_set():
                waiter = asyncio.ensure_future(wake.wait())
                try:
                    await asyncio.wait((reader, waiter), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
            if wake.is_set():
                wake.clear()
                yield WAKE
            if reader.done():
                req = reader.result()  # the request stream's own errors (its deadline, a bad message) are raised here
                if req is _END:
                    return
                reader = asyncio.ensure_future(anext(requests, _END))
                yield req
    finally:
        reader.cancel()  # a read still waiting; then its outcome is taken, so the stream is never closed mid-read
        await asyncio.gather(reader, return_exceptions=True)


async def _no_chunks():
    """The request stream of a TranslateByKey call after its header: nothing."""
    return
    yield  # makes this an async generator


class _Sender:
    """Writes the response messages in order, one in flight at a time, while the next one is built: the write of
    message i (gRPC copies and sends it off the event loop) overlaps building message i + 1.

    The deadline covers sending too: a caller that stops reading blocks a write (flow control) and must not hold
    its stream slot past max_stream_seconds."""

    def __init__(self, context, deadline: float):
        self.context, self.deadline = context, deadline
        self.pending: asyncio.Future | None = None

    async def send(self, msg) -> None:
        await self.drain()
        self.pending = asyncio.ensure_future(self._write(msg))
        await asyncio.sleep(0)  # let the write reach gRPC before the next message is built

    async def drain(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            await pending

    async def settle(self) -> None:
        """After a failure: let a write still in flight finish or fail (it ends by the deadline) before the status
        goes out, since gRPC takes no status while a message is being sent; its error is the caller leaving."""
        pending, self.pending = self.pending, None
        if pending is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):  # the failure being handled is what counts
                await pending

    async def _write(self, msg) -> None:
        try:
            async with asyncio.timeout_at(self.deadline):  # no task per message (wait_for made one)
                await self.context.write(msg)
        except TimeoutError:
            raise TimeoutError(
                "the caller did not read the response before the sidecar's max_stream_seconds ran out"
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception:  # gRPC refuses writes into a call the caller has cancelled or left
            raise CallerGone("the caller cancelled or left the Translate stream; nothing more can be sent") from None


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
            mappings=[mapping_info(e, self.gate_arm) for e in self.registry.entries(request.name_prefix)]
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
            sender = _Sender(context, deadline)
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
        async with contextlib.aclosing(_before(request_iterator, deadline)) as requests:
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
        async for out in self._translate_stream(request.header, _no_chunks()):
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
        async with contextlib.aclosing(_with_wakes(requests, wake)) as stream:
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
