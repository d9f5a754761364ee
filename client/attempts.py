"""One Translate call's attempts, apart from any I/O: the retry policy (which failures are retried, after how long,
within the caller's deadline), the decoding of each attempt's responses, and the state machine both clients
drive (``Attempts``)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvferry.common import wire
from kvferry.common.messages import PAGED, Block, Stats, TargetInfo
from kvferry.common.status import error_for
from kvferry.mappings.cache import LayerKV
from kvferry.v1 import translate_pb2 as pb

from .importers import contiguous_layers
from .regions import Lease

if TYPE_CHECKING:  # the options are the client's; this module is below it
    from .client import Retry


@dataclass
class TranslateResult:
    """A translation's answer. The blocks' tensors view the bytes they arrived in (a sidecar's messages, or a direct
    hit's fetched blobs): read or copy them, never write them in place (``.clone()`` gives a writable copy); so may
    ``layers()`` for a layer that arrived in one block."""

    info: TargetInfo
    blocks: list[Block]
    stats: Stats
    first_block_seconds: float = 0.0
    attempts: int = 1

    def layers(self) -> list[LayerKV]:
        """Contiguous layout: per target layer (K, V) [1, kv_heads, tokens, head_dim]."""
        return contiguous_layers(self.blocks, self.info.layers, self.info.num_tokens)


class Collector:
    """One attempt's response messages, decoded: the header, the blocks (kept for a result, or handed on by a
    stream), the trailer."""

    def __init__(self, region: Lease | None = None, keep: bool = True):
        self.region = region  # the call's response region: its messages arrive undecoded, and are decoded against it
        self.keep = keep  # keep the blocks for the result (a stream hands them on instead)
        self.handed = 0  # blocks decoded so far
        self.info = None
        self.blocks: list[Block] = []
        self.stats = None
        self.t0 = time.perf_counter()
        self.first_block = 0.0

    def take(self, msg: pb.TranslateResponse | Block | bytes) -> Block | None:
        """Decode one response message; the block it carried, if any."""
        if isinstance(msg, bytes):
            msg = wire.decode_response(msg, self._taken())
        if isinstance(msg, Block):  # decoded in place by wire.decode_response
            return self._block(msg)
        which = msg.WhichOneof("msg")
        if which == "header":
            self.info = wire.info_from_pb(msg.header)
        elif which == "block":
            return self._block(wire.block_from_pb(msg.block, self._taken()))
        elif which == "trailer":
            self.stats = wire.stats_from_pb(msg.trailer)
        return None

    def _taken(self) -> Lease | None:
        """The region, once the response header said the sidecar took it (tensors may then lie there)."""
        return self.region if self.info is not None and self.info.response_region else None

    def _block(self, b: Block) -> Block:
        if not self.handed:
            self.first_block = time.perf_counter() - self.t0
        if self.info is not None and self.info.layout == PAGED and not self.info.pages_per_block:
            b.key, b.value = b.key[None], b.value[None]  # one page a block, sent [block_size, H, D]: one page
        if self.keep:
            self.blocks.append(b)
        self.handed += 1
        return b

    def result(self, attempts: int) -> TranslateResult:
        if self.info is None or self.stats is None:
            raise ConnectionError("the sidecar closed the Translate stream without a header or trailer")
        return TranslateResult(self.info, self.blocks, self.stats, self.first_block, attempts)


_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


MAX_RETRY_WAIT = 30.0
"""The longest a client waits before a retry, whatever a server's RetryInfo asks (a hostile or broken server could
ask for years); the caller's deadline caps it further."""


def retry_hint(err: grpc.RpcError) -> float | None:
    """Seconds the server asks us to wait (google.rpc.RetryInfo in the status details), or None when it gave none or
    gave one that does not parse as a duration of 0 to MAX_RETRY_WAIT seconds (not a hint to act on)."""
    try:
        rich = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
        for detail in rich.details if rich is not None else ():
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                seconds = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
                return seconds if 0 <= seconds <= MAX_RETRY_WAIT else None
    except Exception:  # details that do not parse (bad protobuf, a code that disagrees): no hint
        return None
    return None


def retryable(err: grpc.RpcError) -> bool:
    code = err.code() if hasattr(err, "code") else None
    if (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED
    ):  # only a server that says when to retry (the stream cap), not a size limit
        return retry_hint(err) is not None
    return code in _RETRYABLE


def backoff_delay(retry: Retry, attempt: int, err: grpc.RpcError) -> float:
    """Exponential backoff with jitter, never shorter than the server's RetryInfo, never longer than MAX_RETRY_WAIT."""
    return min(MAX_RETRY_WAIT, max(retry.backoff * (2**attempt) * (0.5 + random.random()), retry_hint(err) or 0.0))


def retry_wait(retry: Retry, attempt: int, err: grpc.RpcError, deadline: Deadline, handed: bool) -> float | None:
    """Seconds to wait before retrying a call whose attempt ``attempt`` (0-based) failed with ``err``; None: give up
    and raise it. Never after a stream handed blocks to its caller, past ``retry.retries``, for a status that is not
    retryable, or where the wait would end past the caller's deadline."""
    wait = backoff_delay(retry, attempt, err)
    if handed or attempt >= retry.retries or not retryable(err) or not deadline.allows(wait):
        return None
    return wait


class Deadline:
    """The caller's timeout across all attempts of one call: each attempt gets what remains, and a retry whose wait
    would end past it is not made (the last error is raised instead)."""

    def __init__(self, timeout: float | None):
        self.end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def allows(self, wait: float) -> bool:
        return self.end is None or time.monotonic() + wait < self.end


class Attempts:
    """The attempts of one call, sans I/O: both clients drive it, each with its own channel and sleep.

        attempts = Attempts(endpoints, regions, options, spec, layers, timeout, out)
        while True:
            attempt = attempts.next()
            try:
                for msg in attempts.open(attempt):      # `async for` on the asyncio client
                    block = attempt.take(msg)
                    if block is not None:
                        yield block                     # a live stream's blocks, as they are decoded
                attempts.succeeded(attempt)
                return
            except grpc.RpcError as err:
                sleep(attempts.failed(attempt, err))  # raises the call's typed error when it is over
            finally:
                attempt.close()

    ``out`` (a TranslateStream or AsyncTranslateStream) gets the header as it arrives, then the result. A failure
    is retried at once when it was TranslateByKey on an endpoint that lacks it (through Translate), after a backoff
    on the next endpoint when it is retryable (retry_wait), and raised otherwise."""

    def __init__(self, endpoints, regions, options, spec, layers: list, timeout: float | None, out):
        self.endpoints, self.regions, self.options = endpoints, regions, options
        self.spec, self.layers, self.out = spec, layers, out
        self.deadline = Deadline(timeout)
        self.count = 0  # attempts that failed and were retried after a wait

    def next(self) -> Attempt:
        """The next attempt: a response region leased for it (when the client has them), and a fresh collector."""
        region = self.regions.lease() if self.regions is not None else None
        return Attempt(region, Collector(region, keep=not self.out.live), self.out)

    def open(self, attempt: Attempt):
        """The attempt's response stream, opened on the current endpoint with what remains of the deadline."""
        attempt.call = self.endpoints.call(self.spec, self.layers, self.deadline.remaining(), attempt.region)
        return attempt.call

    def succeeded(self, attempt: Attempt) -> None:
        self.out.finish(attempt.collector.result(self.count + 1))
        attempt.ok = True

    def failed(self, attempt: Attempt, err: grpc.RpcError) -> float:
        """Seconds to wait before the next attempt (0: at once); raises the call's typed error when it is over."""
        handed = self.out.live and attempt.collector.handed > 0
        if not handed and self.endpoints.by_key_refused(self.spec, self.layers, err):
            return 0.0  # the same attempt, through Translate
        wait = retry_wait(self.options.retry, self.count, err, self.deadline, handed)
        if wait is None:
            raise error_for(err) from None
        self.endpoints.fail_over()
        self.count += 1
        return wait


class Attempt:
    """One try of a call: its response region, its collector, its call (cancelled unless it ended well)."""

    def __init__(self, region: Lease | None, collector: Collector, out):
        self.region, self.collector, self.out = region, collector, out
        self.call = None
        self.ok = False

    def take(self, msg) -> Block | None:
        """Decode one response message; the block to hand to a live stream's caller, if any."""
        block = self.collector.take(msg)
        self.out.info = self.collector.info
        return block if self.out.live else None

    def close(self) -> None:
        if not self.ok and self.call is not None:
            self.call.cancel()  # a stream its caller closed early, or a failed attempt: the sidecar stops at once
        if self.region is not None:
            self.region.release(self.ok)
