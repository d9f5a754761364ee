"""One Translate call's work, with no gRPC in it: open a session from the header (map, limits, the prefix store's
part), feed it chunks on the compute thread, finish it (stats, metrics, write-back). The servicer only adapts
messages to these calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from kvferry.common.errors import Unsupported
from kvferry.common.messages import Chunk, Stats, TranslateSpec
from kvferry.mappings.artifact import MapSet

from .compute import ComputeThread, on_compute
from .limits import Limits
from .pipeline import TranslateSession, start_session

log = logging.getLogger("kvferry.sidecar")


@dataclass
class Opened:
    """A started translation: its session, the map it uses, and what the prefix store already held."""

    session: TranslateSession
    ms: MapSet
    plan: object | None  # prefix_flow.Plan: where newly mapped blocks would be written back
    cached_blocks: int
    initial: list  # the blocks that need no source data (a cached prefix: Block or BlockBytes), to send first


class TranslateFlow:
    """The sidecar's translation logic. ``compute`` is the one thread all tensor work runs on (compute.py)."""

    def __init__(self, registry, limits: Limits, metrics, prefix, compute: ComputeThread):
        self.registry, self.limits, self.metrics, self.prefix, self.compute = registry, limits, metrics, prefix, compute
        self._background: set[asyncio.Task] = set()

    async def open(self, spec: TranslateSpec) -> Opened:
        """Resolve the map, consult the prefix store, start the session and cut the cached prefix's blocks."""
        ms = self.registry.resolve(spec.map_name, spec.map_version)
        self.limits.check(spec.num_tokens, 0)  # before the prefix store hashes, reads, maps or writes anything
        if spec.prefix_key:
            if self.prefix is None:
                raise Unsupported(
                    "this sidecar runs without a prefix store (prefix_cache = false); stream the source KV"
                )
            session, initial, cached_blocks = await asyncio.to_thread(
                self.prefix.from_store, spec, ms, self.limits, self.compute
            )
            return Opened(session, ms, None, cached_blocks, initial)
        plan = await self._plan(spec, ms) if self.prefix is not None and spec.token_ids else None
        cached = plan.lookup if plan and plan.lookup.blocks else None
        write_back = plan is not None and self.prefix.write_streamed
        session, initial = await on_compute(
            self.compute, start_session, spec, ms, self.limits, cached, True, write_back, self.compute.lanes
        )
        return Opened(session, ms, plan if write_back else None, len(plan.lookup.blocks) if plan else 0, initial)

    async def _plan(self, spec: TranslateSpec, ms: MapSet):
        """The stored blocks of a streamed request, or None. It waits at most prefix_probe_seconds on a store that
        does not answer (the probe's thread ends on the store's own timeout, which opens its circuit), and not at all
        while the circuit is open; a store that answers the probe is then read within its timeout."""
        if not self.prefix.consulted(spec):
            return None
        try:
            stored = await asyncio.wait_for(asyncio.to_thread(self.prefix.probe, spec, ms), self.prefix.probe_seconds)
            if stored is None:
                return None
            return await asyncio.wait_for(asyncio.to_thread(self.prefix.plan, spec, ms, stored), self.prefix.timeout)
        except TimeoutError:
            return None

    async def add(self, opened: Opened, chunk: Chunk, encode) -> list:
        """Map what ``chunk`` completes on the compute thread, and ``encode`` each block there too."""
        return await on_compute(self.compute, _encoded, encode, opened.session.add, chunk)

    def wake_event(self, opened: Opened) -> asyncio.Event | None:
        """An event set whenever the session's map finishes output between chunks (lanes), for ``poll``; None when
        its output always comes back from ``add``."""
        loop, wake = asyncio.get_running_loop(), asyncio.Event()

        def on_output() -> None:  # on a lane's thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
                loop.call_soon_threadsafe(wake.set)

        return wake if opened.session.wake_on_output(on_output) else None

    async def poll(self, opened: Opened, encode) -> list:
        """What the session's map finished since: encoded on the compute thread."""
        return await on_compute(self.compute, _encoded, encode, opened.session.poll)

    async def drain(self, opened: Opened, encode) -> list:
        """End of the request stream: wait for the map's last work, and ``encode`` the blocks it completed."""
        return await on_compute(self.compute, _encoded, encode, opened.session.drain)

    def finish(self, opened: Opened) -> Stats:
        """End of the request stream: the stats, the metrics, and (off the critical path) the write-back."""
        stats = opened.session.finish()
        stats.cached_blocks = opened.cached_blocks
        if opened.plan is not None and opened.session.outputs:
            task = asyncio.create_task(
                asyncio.to_thread(self.prefix.write_back, opened.plan, opened.session, self.compute)
            )
            self._background.add(task)  # keep a reference until it finishes
            task.add_done_callback(self._write_back_done)
        label = f"{opened.ms.name}@{opened.ms.version}"
        self.metrics.tokens.labels(label).inc(stats.tokens)
        self.metrics.bytes_in.labels(label).inc(stats.bytes_in)
        self.metrics.bytes_out.labels(label).inc(stats.bytes_out)
        self.metrics.compute.labels(label).observe(stats.compute_seconds)
        return stats

    @property
    def settled(self) -> bool:
        """No write-back of a finished translation is still running."""
        return not self._background

    def _write_back_done(self, task: asyncio.Task) -> None:
        """A write-back that failed in a way the prefix service did not expect is counted and logged once, here:
        never an unretrieved task exception, never the caller's problem (its answer was already sent)."""
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.metrics.prefix_store_errors.inc()
            log.error("prefix write-back failed: %s: %s", type(task.exception()).__name__, str(task.exception())[:200])


def _encoded(encode, produce, *args) -> list:
    """``encode`` each block ``produce(*args)`` returns (on the compute thread, as both touch tensor data)."""
    return [encode(b) for b in produce(*args)]
