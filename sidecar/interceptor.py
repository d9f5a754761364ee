"""The one place where domain errors become gRPC status codes (and RPCs are counted)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvferry.common.status import status_for

from .auth import CALLER, PROTECTED_PREFIX

log = logging.getLogger("kvferry.rpc")

RETRY_AFTER_KEY = "kvferry-retry-after-ms"
"""Plain trailing metadata beside google.rpc.RetryInfo, for clients without a rich-status parser."""


def retry_details(code: grpc.StatusCode, msg: str, retry_after: float) -> tuple:
    """Trailing metadata carrying google.rpc.Status with a RetryInfo detail (and the plain millisecond hint)."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(retry_after * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    rich = rpc_status.to_status(status_pb2.Status(code=code.value[0], message=msg, details=[detail]))
    return (*rich.trailing_metadata, (RETRY_AFTER_KEY, str(round(retry_after * 1000))))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: authenticates kvferry calls (when configured), then KvferryError -> its
    status; anything else -> INTERNAL, logged."""

    def __init__(self, metrics=None, authenticator=None):
        self.metrics = metrics
        self.auth = authenticator

    def _authenticate(self, context, full_method: str) -> None:
        if self.auth is not None and self.auth.enabled and full_method.startswith(PROTECTED_PREFIX):
            CALLER.set(self.auth.identify(context.invocation_metadata(), context.auth_context()))

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        full_method = details.method
        method = full_method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method, full_method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(handler.stream_stream, method, full_method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method, full_method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler

    def _done(self, method: str, code: grpc.StatusCode, t0: float) -> None:
        if self.metrics:
            self.metrics.requests.labels(method, code.name).inc()
            self.metrics.latency.labels(method).observe(time.perf_counter() - t0)

    async def _fail(self, context, exc: BaseException, method: str, t0: float) -> bool:
        """Send ``exc``'s status (raises AbortError, which ends the handler). Returns True, raising nothing, when the
        status cannot be sent because the caller has already gone (it cancelled, or its connection dropped while
        the failure was being handled): an expected end, logged at debug level, never with a traceback."""
        code = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed unexpectedly", method, exc_info=exc)
            msg = f"internal error: {type(exc).__name__}: {exc}"
        else:
            msg = str(exc)
            detail = getattr(exc, "detail", "")
            if detail and detail != msg:  # the operator's words (a store's redacted address), not the caller's
                log.warning("%s: %s", method, detail)
        self._done(method, code, t0)
        retry_after = getattr(exc, "retry_after", None)
        exc.__traceback__ = None  # its frames hold the request messages, and the abort below chains this exception
        trailing = () if retry_after is None else retry_details(code, msg, retry_after)
        try:
            await context.abort(code, msg, trailing_metadata=trailing)
        except grpc.aio.AbortError:
            raise
        except Exception as gone:  # gRPC's ExecuteBatchError: the call is over on the caller's side
            log.debug("%s: %s, and the caller had gone before the status (%s)", method, code.name, type(gone).__name__)
            return True
        return False

    def _guard(self, context, method: str, full_method: str) -> _Guard:
        return _Guard(self, context, method, full_method)

    def _unary(self, fn, method, full_method):
        async def wrapper(request, context):
            async with self._guard(context, method, full_method):
                return await fn(request, context)

        return wrapper

    def _stream(self, fn, method, full_method):
        # ``request``: the request iterator of a stream-stream call, the request of a unary-stream one.
        if not inspect.isasyncgenfunction(fn):  # a handler that writes with context.write() itself (Translate*)

            async def writer(request, context):
                # gRPC keeps the AbortError of a failed call, and its traceback keeps this frame: hold the request
                # (or the iterator, whose receiver keeps the last request message, up to max_message_bytes) only in
                # the call.
                requests = [request]
                del request
                async with self._guard(context, method, full_method):
                    await fn(requests.pop(), context)

            return writer

        async def wrapper(request, context):
            async with self._guard(context, method, full_method):
                async for item in fn(request, context):
                    yield item

        return wrapper


class _Guard:
    """Authenticate, run the body, count the outcome: a domain error becomes its status, anything else INTERNAL
    (logged), a cancellation CANCELLED (no traceback).

    A class, not @asynccontextmanager: that one throws the exception back into its generator with the traceback
    and keeps it on its frame, so the AbortError gRPC keeps after a failed call would hold every frame of the
    handler, and with them the request messages (a header of millions of token_ids is tens of MB once parsed)."""

    def __init__(self, owner: ErrorInterceptor, context, method: str, full_method: str):
        self.owner, self.context, self.method, self.full_method = owner, context, method, full_method

    async def __aenter__(self) -> None:
        self.t0 = time.perf_counter()
        try:
            self.owner._authenticate(self.context, self.full_method)
        except Exception as exc:  # an auth failure is a status like any other
            await self.owner._fail(self.context, exc, self.method, self.t0)

    async def __aexit__(self, typ, exc, tb) -> bool:
        del tb
        if exc is None:
            self.owner._done(self.method, grpc.StatusCode.OK, self.t0)
        elif isinstance(exc, asyncio.CancelledError):  # the caller cancelled while we waited on it
            self.owner._done(self.method, grpc.StatusCode.CANCELLED, self.t0)
        elif isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
            return await self.owner._fail(self.context, exc, self.method, self.t0)  # raises AbortError with the status
        return False
