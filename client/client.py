"""TranslateClient (sync) and AsyncTranslateClient: stream a source cache in, get target KV back.

Both share the request encoding and response decoding below; they differ only in the channel.
UNAVAILABLE is retried with exponential backoff (a translation is idempotent); deadlines and TLS
are options. Nothing here imports the sidecar.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import grpc.experimental
import torch

from kvferry.common import wire
from kvferry.common.channel import MAX_MESSAGE_BYTES, message_size_options
from kvferry.common.errors import InvalidInput
from kvferry.common.listing import MappingInfo, mapping_from_pb
from kvferry.common.messages import ALL_PAGES, CONTIGUOUS, PAGED, Block, Chunk, Stats, TargetInfo, TranslateSpec
from kvferry.common.settings import check_range
from kvferry.common.status import error_for
from kvferry.mappings.cache import LayerKV, cache_layers
from kvferry.mappings.versions import serving_version
from kvferry.v1 import translate_pb2 as pb
from kvferry.v1 import translate_pb2_grpc as pb_grpc

from .attempts import Attempts, TranslateResult
from .regions import Lease, RegionPool
from .tls import tls_credentials

CHUNK_BYTES = 2 << 20
"""The automatic source chunk: about this many bytes of one layer's K or V per message (under gRPC's common 4 MiB)."""
CHUNK_OVERHEAD = 1024
"""Room left in a message for a chunk's fields besides its data."""


@dataclass(frozen=True)
class Retry:
    """How a failed call is tried again (a translation is idempotent)."""

    retries: int = 3
    """Retries of UNAVAILABLE (and RESOURCE_EXHAUSTED from the stream cap) before giving up."""
    backoff: float = 0.05
    """First retry delay in seconds; doubles each retry, with jitter (a server's RetryInfo can lengthen it)."""

    def __post_init__(self) -> None:
        check_range("retries", self.retries, 0, 100)
        check_range("backoff", self.backoff, 0, 60)


@dataclass(frozen=True)
class Tls:
    """TLS to the sidecar: on when ``root_certs`` is set."""

    root_certs: str = ""
    """PEM CA bundle that verifies the server."""
    client_cert: str = ""
    """PEM client certificate, for mutual TLS (with ``client_key``)."""
    client_key: str = ""
    """PEM client key, for mutual TLS (with ``client_cert``)."""
    server_name: str = ""
    """Override of the name checked against the server certificate."""

    def __post_init__(self) -> None:
        if bool(self.client_cert) != bool(self.client_key):
            raise InvalidInput("Tls: give client_cert and client_key together (mutual TLS), or neither")
        if (self.client_cert or self.server_name) and not self.root_certs:
            raise InvalidInput("Tls: client_cert and server_name need root_certs (the CA that verifies the server)")


@dataclass(frozen=True)
class SharedMemory:
    """Answers through files in a folder shared with the sidecar alone (its shm_dir: a memory-backed volume of the
    pod both containers mount): the sidecar writes each answer's tensor bytes into a file the client keeps there
    (client/regions.py) instead of into the messages, skipping gRPC's copies of large answers; the answer's
    tensors view that file. A sidecar without shm_dir answers in the messages."""

    dir: str = ""
    """The shared folder (the sidecar's shm_dir). Empty: always in the messages."""
    region_bytes: int = 1 << 30
    """Size of each file: the most response bytes one call puts there (the rest come in the messages). The file is
    sparse: memory is used only as the sidecar writes."""
    file_mode: int = 0o600
    """Permissions of the files: 0o660 when the sidecar runs as another user sharing the pod's fsGroup."""
    idle_files: int = 4
    """Files a client keeps for reuse once their answers are freed (each holds the memory of the largest answer
    written into it); an answer still in use keeps its own."""

    def __post_init__(self) -> None:
        check_range("SharedMemory.region_bytes", self.region_bytes, 1, 1 << 40)
        check_range("SharedMemory.idle_files", self.idle_files, 0, 1024)
        if self.file_mode not in (0o600, 0o660):
            raise InvalidInput(
                f"SharedMemory.file_mode must be 0o600 or 0o660 (the caller's file, never others'), got "
                f"{oct(self.file_mode)}"
            )


@dataclass(frozen=True)
class ClientOptions:
    """How to reach a sidecar."""

    target: str = "127.0.0.1:50551"
    """host:port of the sidecar."""
    timeout: float | None = 30.0
    """Deadline per Translate call, seconds, retries included (None: no deadline)."""
    retry: Retry = field(default_factory=Retry)
    """How failed calls are retried."""
    endpoints: tuple[str, ...] = ()
    """More sidecars to fail over to (host:port): a retryable error moves the next attempt to the next endpoint."""
    tls: Tls = field(default_factory=Tls)
    """TLS to the sidecar (off by default)."""
    auth_token: str = ""
    """Bearer token sent as 'authorization' call metadata (the sidecar's auth_tokens_file maps it to a tenant)."""
    shared_memory: SharedMemory = field(default_factory=SharedMemory)
    """Answers through a folder shared with the sidecar (off by default)."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """gRPC max send/receive message size on the channel."""
    chunk_tokens: int = 0
    """Tokens per source chunk; 0 (the default): as many as fill ``CHUNK_BYTES`` (2 MiB) of one layer's K or V,
    within max_message_bytes. Each message costs the sidecar a fixed amount, so far smaller chunks are slower
    (`kvferry bench translate --chunk-tokens N` measures it)."""

    def __post_init__(self) -> None:
        if self.timeout is not None:
            check_range("timeout", self.timeout, 0, 86400, low_open=True)
        check_range("chunk_tokens", self.chunk_tokens, 0, 1 << 31)
        check_range("max_message_bytes", self.max_message_bytes, 1 << 16, 1 << 31)

    def region_pool(self) -> RegionPool | None:
        """The response regions of one client (None without shm_dir)."""
        return (
            RegionPool(sm.dir, sm.region_bytes, sm.file_mode, sm.idle_files) if (sm := self.shared_memory).dir else None
        )

    def tokens_per_chunk(self, bytes_per_token: int) -> int:
        """The chunk size to send a cache with ``bytes_per_token`` bytes of K (or V) per token and layer."""
        if self.chunk_tokens:
            return self.chunk_tokens
        budget = min(CHUNK_BYTES, self.max_message_bytes - CHUNK_OVERHEAD)
        return max(1, budget // max(1, bytes_per_token))

    def channel_args(self) -> list[tuple[str, object]]:
        opts: list[tuple[str, object]] = [
            *message_size_options(self.max_message_bytes),
        ]
        if self.tls.server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return opts

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else None

    def addresses(self) -> tuple[str, ...]:
        return (self.target, *tuple(e for e in self.endpoints if e != self.target))

    def credentials(self):
        if not self.tls.root_certs:
            return None
        return tls_credentials(self.tls.root_certs, self.tls.client_key, self.tls.client_cert)


def chunk_tokens_for(options: ClientOptions, layers: list[LayerKV]) -> int:
    """Tokens per source chunk for ``layers`` ((K, V) [1, H, T, D] or [H, T, D] per layer) under ``options``."""
    t = layers[0][0] if layers else None
    return options.tokens_per_chunk(t.shape[-3] * t.shape[-1] * t.element_size() if t is not None else 1)


def encode_requests(
    spec: TranslateSpec, layers: list[LayerKV], chunk_tokens: int, order: str = "tokens", encoded: bool = False
) -> Iterator[pb.TranslateRequest | bytes]:
    """Header, then chunks. ``order="tokens"``: each token range for every layer before the next range,
    so the sidecar can map and return range by range while the rest is in flight; ``"layers"``: layer by
    layer. Tensors are sliced, not copied, until encoding; ``encoded=True`` yields the chunks as serialised
    bytes written straight from the tensor views (what the client sends)."""
    yield wire.spec_to_pb(spec)
    views = [
        (layer, kind, (t[0] if t.dim() == 4 else t))
        for layer, (k, v) in enumerate(layers)
        for kind, t in (("k", k), ("v", v))
    ]
    n = views[0][2].shape[1] if views else 0
    ranges = [(s, min(s + chunk_tokens, n)) for s in range(0, n, chunk_tokens)]
    pairs = [(r, v) for r in ranges for v in views] if order == "tokens" else [(r, v) for v in views for r in ranges]
    for (s, e), (layer, kind, t) in pairs:
        chunk = Chunk(layer, kind, s, e, t[:, s:e])
        yield wire.encode_chunk_request(chunk) if encoded else wire.chunk_to_pb(chunk)


@dataclass(frozen=True)
class Request:
    """A translation request's header fields beyond the map: the keywords of ``translate``, ``stream`` and
    ``make_spec``, defined here once."""

    source_geometry: str = ""
    """The source model's geometry fingerprint; the sidecar refuses a map made for another source."""
    tokenizer: str = ""
    """The source tokenizer's fingerprint; the sidecar refuses a map made for another tokenizer."""
    token_ids: object = ()
    """The prompt's token ids (a list, tuple or tensor of ints): the prefix store's key (reads, write-back) and, with
    ``prefix_key``, the whole of a key-only request."""
    start_position: int = 0
    """Position of the first source token (RoPE)."""
    layout: str = CONTIGUOUS
    """How target blocks come back: CONTIGUOUS (per layer and token range) or PAGED (pages of ``block_size``)."""
    block_size: int = 16
    """Tokens per page of a PAGED answer."""
    pages_per_block: int = ALL_PAGES
    """PAGED answers carry up to this many pages a message (the sidecar caps it to its message size; 0 asks for one
    page a message); they reach the caller as [pages, block_size, kv_heads, head_dim] blocks either way."""
    target_dtype: torch.dtype | None = None
    """The target blocks' dtype (None: the map's)."""
    tenant: str = ""
    """The prefix-store namespace asked for (a sidecar with auth takes the caller's own instead)."""
    prefix_key: str = ""
    """The key ``publish_source`` returned: the source KV is read from the prefix store (send no layers)."""
    source_dtype: torch.dtype | None = None
    """A key-only request's source dtype (stored blocks are mapped as published, whatever this says)."""


def make_spec(layers: list[LayerKV], map_name: str, version: str = "", **request) -> TranslateSpec:
    """The request header for ``layers`` (or for a key-only request: ``token_ids``, ``prefix_key``); the keywords
    are Request's fields."""
    r = Request(**request)
    if layers:
        n, dtype = int(layers[0][0].shape[-2]), layers[0][0].dtype
    else:  # key-only: the source KV is in the prefix store
        n, dtype = len(r.token_ids), r.source_dtype or torch.float32
    return TranslateSpec(
        map_name,
        version,
        r.source_geometry,
        r.tokenizer,
        n,
        r.start_position,
        _token_ids(r.token_ids),
        dtype,
        r.layout,
        r.block_size,
        r.target_dtype,
        r.prefix_key,
        r.tenant,
        r.pages_per_block if r.layout == PAGED else 0,
    )


def _request(options: ClientOptions, cache, map_name: str, version: str, request: dict, timeout: float | None):
    """What a translate or stream call sends: (the source layers, the request header from the call's Request
    keywords, the call's timeout)."""
    layers = cache_layers(cache)
    return layers, make_spec(layers, map_name, version, **request), options.timeout if timeout is None else timeout


def _token_ids(token_ids) -> tuple[int, ...]:
    """Token ids as a tuple of ints. A list or tuple of ints is taken as it is (0.15 ms per 8k ids to check, against
    0.34 ms for an int() per id); anything else is converted id by id."""
    if isinstance(token_ids, torch.Tensor):
        return tuple(token_ids.tolist())
    if type(token_ids) in (list, tuple) and set(map(type, token_ids)) <= {int}:  # C loops, not a generator
        return tuple(token_ids)
    return tuple(map(int, token_ids))


def _direct_result(hit) -> TranslateResult:
    return TranslateResult(hit.info, hit.blocks, hit.stats, hit.stats.wall_seconds, attempts=0)


def serving_mapping(listed, name: str, version: str = "") -> MappingInfo | None:
    """Among ListMappings' answer, the map a request for ``name`` (and ``version``, "" for latest) is served with,
    by the sidecar's own rule (mappings.versions.serving_version); None when that version or every one is gated."""
    mine = {m.version: m for m in listed if m.name == name}
    chosen = serving_version({v: m.servable for v, m in mine.items()}, version)
    return mine[chosen] if chosen else None


TRANSLATE_METHOD = "/kvferry.v1.TranslateService/Translate"
BY_KEY_METHOD = "/kvferry.v1.TranslateService/TranslateByKey"


def _method_missing(err: grpc.RpcError) -> bool:
    """UNIMPLEMENTED from a sidecar older than TranslateByKey (gRPC's own answer for an unknown method). A sidecar
    without a prefix store also answers UNIMPLEMENTED; Translate then gives the same status, so a retry through it
    loses one round trip and nothing else."""
    return hasattr(err, "code") and err.code() == grpc.StatusCode.UNIMPLEMENTED


class _Endpoints:
    """One channel per endpoint; ``stub`` and ``call`` use the current one, ``fail_over`` moves to the next.

    ``call`` opens a translation: a key-only one through TranslateByKey (one message), unless this endpoint answered
    that it lacks the method; else through Translate, sending pre-encoded chunks. Both decode blocks in place
    (wire.serialize/decode_response). The stub serves the other RPCs."""

    def __init__(self, options: ClientOptions, make_channel):
        self.options = options
        creds, args = options.credentials(), options.channel_args()
        self.channels = [make_channel(addr, creds, args) for addr in options.addresses()]
        self.stubs = [pb_grpc.TranslateServiceStub(c) for c in self.channels]

        def methods(decode):
            return (
                [
                    c.stream_stream(TRANSLATE_METHOD, request_serializer=wire.serialize, response_deserializer=decode)
                    for c in self.channels
                ],
                [
                    c.unary_stream(BY_KEY_METHOD, request_serializer=wire.serialize, response_deserializer=decode)
                    for c in self.channels
                ],
            )

        self.translates, self.by_keys = methods(wire.decode_response)
        self.raw_translates, self.raw_by_keys = methods(None)  # a call with a response region decodes against it
        self.has_by_key = [True] * len(self.channels)  # until an endpoint says it lacks the method
        self.current = 0

    @property
    def stub(self) -> pb_grpc.TranslateServiceStub:
        return self.stubs[self.current]

    def uses_by_key(self, spec: TranslateSpec, layers: list) -> bool:
        return bool(spec.prefix_key) and not layers and self.has_by_key[self.current]

    def call(self, spec: TranslateSpec, layers: list, timeout: float | None, region: Lease | None = None):
        """The response stream of one attempt (iterate it; async iterate with the asyncio channel). With a ``region``,
        the request names it and the messages come undecoded (``attempts.Collector`` decodes them against it)."""
        meta = self.options.metadata()
        by_key = self.uses_by_key(spec, layers)
        if region is not None:
            spec = dataclasses.replace(
                spec, response_region=region.name, response_region_bytes=region.size, response_region_key=region.key
            )
        if by_key:
            call = (self.by_keys if region is None else self.raw_by_keys)[self.current]
            return call(wire.spec_to_pb(spec, pb.TranslateByKeyRequest), timeout=timeout, metadata=meta)
        call = (self.translates if region is None else self.raw_translates)[self.current]
        return call(
            encode_requests(spec, layers, chunk_tokens_for(self.options, layers), encoded=True),
            timeout=timeout,
            metadata=meta,
        )

    def by_key_refused(self, spec: TranslateSpec, layers: list, err: grpc.RpcError) -> bool:
        """After a failed attempt: was it TranslateByKey on an endpoint without it? Then remember, and retry now."""
        if self.uses_by_key(spec, layers) and _method_missing(err):
            self.has_by_key[self.current] = False
            return True
        return False

    def fail_over(self) -> None:
        self.current = (self.current + 1) % len(self.stubs)


SINGLE_THREADED_STREAMS = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)
"""gRPC Python's option to receive a unary-stream call's messages (TranslateByKey) on the thread that iterates them,
with no helper thread started per call to hand each message over: a thread start fewer per call, which is most of
what a one-block hit costs beyond the store's read (`kvferry bench hits`). Experimental in gRPC; a gRPC without it
ignores it."""


def _sync_channel(addr, creds, args):
    args = [*args, SINGLE_THREADED_STREAMS]
    return grpc.secure_channel(addr, creds, args) if creds else grpc.insecure_channel(addr, args)


def _aio_channel(addr, creds, args):
    return grpc.aio.secure_channel(addr, creds, args) if creds else grpc.aio.insecure_channel(addr, args)


class TranslateClient:
    """Blocking client. With a ``direct`` reader (kvferry.client.direct), key-only translations whose mapped blocks
    are all in the prefix store are read from it without a sidecar hop."""

    def __init__(self, options: ClientOptions | str = ClientOptions(), direct=None):
        self.options = ClientOptions(target=options) if isinstance(options, str) else options
        self.endpoints = _Endpoints(self.options, _sync_channel)
        self.direct = direct
        self.regions = self.options.region_pool()

    def close(self) -> None:
        for c in self.endpoints.channels:
            c.close()
        if self.regions is not None:
            self.regions.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def list_mappings(self, name_prefix: str = "") -> list[MappingInfo]:
        """The maps the sidecar knows whose name starts with ``name_prefix``, oldest version first."""
        try:
            resp = self.endpoints.stub.ListMappings(
                pb.ListMappingsRequest(name_prefix=name_prefix),
                timeout=self.options.timeout,
                metadata=self.options.metadata(),
            )
        except grpc.RpcError as err:
            raise error_for(err) from None
        return [mapping_from_pb(m) for m in resp.mappings]

    def translate(
        self,
        cache,
        map_name: str,
        version: str = "",
        *,
        timeout: float | None = None,
        **request,
    ) -> TranslateResult:
        """Translate a source cache (an HF cache or a list of (K, V) [1, H, T, D]; None with ``prefix_key`` and
        ``token_ids`` for a key-only request) through ``map_name`` (``version``: exact, or "" for the latest servable).
        ``request``: Request's fields, the header's keywords; ``timeout``: seconds for the whole call, retries included
        (None: ClientOptions.timeout). A failed call raises the service's typed error (kvferry.common.status: NotFound,
        InvalidInput, Unavailable, ...; each is also a grpc.RpcError)."""
        layers, spec, timeout = _request(self.options, cache, map_name, version, request, timeout)
        hit = self._direct_hit(spec)
        if hit is not None:
            return _direct_result(hit)
        out = TranslateStream(live=False)
        for _ in self._attempts(spec, layers, timeout, out):
            raise AssertionError("a call without a live stream yields no block")
        return out.result

    def stream(
        self,
        cache,
        map_name: str,
        version: str = "",
        *,
        timeout: float | None = None,
        **request,
    ) -> TranslateStream:
        """As ``translate``, but the blocks are handed over as they arrive (a TranslateStream to iterate), so a
        caller can import the first target layers while later ones are still on the wire."""
        layers, spec, timeout = _request(self.options, cache, map_name, version, request, timeout)
        out = TranslateStream()
        out._blocks = self._streamed(spec, layers, timeout, out)
        return out

    def _streamed(self, spec: TranslateSpec, layers: list, timeout: float | None, out: TranslateStream):
        hit = self._direct_hit(spec)
        if hit is not None:
            out.finish(_direct_result(hit))
            yield from hit.blocks
            return
        yield from self._attempts(spec, layers, timeout, out)

    def _direct_hit(self, spec: TranslateSpec):
        if self.direct is None or not spec.prefix_key:
            return None
        try:
            if self.direct.maps_stale:
                self.direct.set_maps(self.list_mappings())
            return self.direct.answer(spec)
        except grpc.RpcError:
            return None  # the sidecar's own path retries and fails over

    def _attempts(self, spec: TranslateSpec, layers: list, timeout: float | None, out: TranslateStream):
        """One call's attempts (attempts.Attempts): a live stream's blocks are yielded as they are decoded."""
        attempts = Attempts(self.endpoints, self.regions, self.options, spec, layers, timeout, out)
        while True:
            attempt = attempts.next()
            try:
                for msg in attempts.open(attempt):
                    block = attempt.take(msg)
                    if block is not None:
                        yield block
                attempts.succeeded(attempt)
                return
            except grpc.RpcError as err:
                time.sleep(attempts.failed(attempt, err))
            finally:
                attempt.close()


class _StreamState:
    """What a call has said so far: its header (``info``), then its result (``finish``)."""

    def __init__(self, live: bool = True) -> None:
        self.live = live  # False: translate() running on the stream's attempt loop, keeping the blocks for its result
        self.info: TargetInfo | None = None
        self.stats: Stats | None = None
        self.result: TranslateResult | None = None
        self.attempts = 0
        self.first_block_seconds = 0.0

    def finish(self, result: TranslateResult) -> None:
        self.result, self.info, self.stats = result, result.info, result.stats
        self.attempts, self.first_block_seconds = result.attempts, result.first_block_seconds


class TranslateStream(_StreamState):
    """A translation's blocks as they arrive (``TranslateClient.stream``): iterate it for each Block, in the order the
    sidecar sends them: a key-only answer (or a source sent in one token range) layer after layer, a source uploaded
    in token ranges range by range, each layer's ranges in order. ``info`` is set once the
    header has arrived, ``stats`` once the trailer has, after the last block. A failure before the first block is
    retried as ``translate`` retries it; after it, the failure is raised: the caller holds blocks it cannot take
    back. Closing the stream early (``close``, or leaving its ``with`` block) cancels the call. Blocks view the bytes
    they arrived in, as TranslateResult's do."""

    def __init__(self, live: bool = True) -> None:
        super().__init__(live)
        self._blocks: Iterator[Block] = iter(())

    def __iter__(self) -> TranslateStream:
        return self

    def __next__(self) -> Block:
        return next(self._blocks)

    def close(self) -> None:
        close = getattr(self._blocks, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> TranslateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTranslateClient:
    """asyncio client (grpc.aio); ``direct`` as for TranslateClient."""

    def __init__(self, options: ClientOptions | str = ClientOptions(), direct=None):
        self.options = ClientOptions(target=options) if isinstance(options, str) else options
        self.endpoints = _Endpoints(self.options, _aio_channel)
        self.direct = direct
        self.regions = self.options.region_pool()

    async def close(self) -> None:
        for c in self.endpoints.channels:
            await c.close()
        if self.regions is not None:
            self.regions.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def list_mappings(self, name_prefix: str = "") -> list[MappingInfo]:
        """As TranslateClient.list_mappings."""
        try:
            resp = await self.endpoints.stub.ListMappings(
                pb.ListMappingsRequest(name_prefix=name_prefix),
                timeout=self.options.timeout,
                metadata=self.options.metadata(),
            )
        except grpc.RpcError as err:
            raise error_for(err) from None
        return [mapping_from_pb(m) for m in resp.mappings]

    async def translate(
        self,
        cache,
        map_name: str,
        version: str = "",
        *,
        timeout: float | None = None,
        **request,
    ) -> TranslateResult:
        """As TranslateClient.translate."""
        layers, spec, timeout = _request(self.options, cache, map_name, version, request, timeout)
        hit = await self._direct_hit(spec)
        if hit is not None:
            return _direct_result(hit)
        out = AsyncTranslateStream(live=False)
        async for _ in self._attempts(spec, layers, timeout, out):
            raise AssertionError("a call without a live stream yields no block")
        return out.result

    def stream(
        self,
        cache,
        map_name: str,
        version: str = "",
        *,
        timeout: float | None = None,
        **request,
    ) -> AsyncTranslateStream:
        """As TranslateClient.stream: ``async for block in client.stream(...)``."""
        layers, spec, timeout = _request(self.options, cache, map_name, version, request, timeout)
        out = AsyncTranslateStream()
        out._blocks = self._streamed(spec, layers, timeout, out)
        return out

    async def _streamed(self, spec: TranslateSpec, layers: list, timeout: float | None, out: AsyncTranslateStream):
        hit = await self._direct_hit(spec)
        if hit is not None:
            out.finish(_direct_result(hit))
            for block in hit.blocks:
                yield block
            return
        async for block in self._attempts(spec, layers, timeout, out):
            yield block

    async def _direct_hit(self, spec: TranslateSpec):
        if self.direct is None or not spec.prefix_key:
            return None
        try:
            if self.direct.maps_stale:
                self.direct.set_maps(await self.list_mappings())
            return await asyncio.to_thread(self.direct.answer, spec)
        except grpc.RpcError:
            return None

    async def _attempts(self, spec: TranslateSpec, layers: list, timeout: float | None, out: AsyncTranslateStream):
        """As TranslateClient._attempts, on the asyncio channel."""
        attempts = Attempts(self.endpoints, self.regions, self.options, spec, layers, timeout, out)
        while True:
            attempt = attempts.next()
            try:
                async for msg in attempts.open(attempt):
                    block = attempt.take(msg)
                    if block is not None:
                        yield block
                attempts.succeeded(attempt)
                return
            except grpc.RpcError as err:
                await asyncio.sleep(attempts.failed(attempt, err))
            finally:
                attempt.close()


class AsyncTranslateStream(_StreamState):
    """TranslateStream for the asyncio client: ``async for``, ``aclose``, ``async with``."""

    def __init__(self, live: bool = True) -> None:
        super().__init__(live)
        self._blocks = None  # the call's async generator, set by AsyncTranslateClient.stream

    def __aiter__(self) -> AsyncTranslateStream:
        return self

    async def __anext__(self) -> Block:
        return await self._blocks.__anext__()

    async def aclose(self) -> None:
        close = getattr(self._blocks, "aclose", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> AsyncTranslateStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
