"""The Translate stream's machinery, apart from what it carries: the request stream cut off at the stream's deadline,
the wake-ups of a map running on lanes merged into it, and the sender that overlaps writing one response message
with building the next."""

from __future__ import annotations

import asyncio
import contextlib

from kvferry.common.errors import CallerGone

from .limits import OversizedHeader


async def before_deadline(requests, deadline: float):
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
"""WAKE: an item with_wakes yields between requests when the map has output to send."""


async def with_wakes(requests, wake: asyncio.Event | None):
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


async def no_chunks():
    """The request stream of a TranslateByKey call after its header: nothing."""
    return
    yield  # makes this an async generator


class Sender:
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
