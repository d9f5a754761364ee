"""A translation's tokens cut into lanes: each lane maps its own token ranges through every layer on its own thread,
running torch on one core, and the lanes never wait for one another. Each range the client sends is shared among the
lanes (``plan``), so they all work while the rest of the upload arrives.

Why: torch's intra-op pool ends every operation at a barrier that waits for its slowest thread, and token slices of
each map step on several threads still meet once a step. While transfers share the cores, a preempted
thread stalls every meeting. Lanes meet only where their outputs are joined, and the thread feeding them does not
wait for them (docs/benchmarks.md, "Where the RPC's time goes").

Maps are per token, so a lane needs only its own tokens' source features; a windowed map's lane also reads the
``context`` tokens before its first (pushed to it, read, never mapped), as any translation starting past position 0
does (apply.py).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from kvferry.mappings.apply import StreamingApplier, check_push
from kvferry.mappings.artifact import MapSet

MIN_SLICE = 128  # tokens: a lane gets at least this many, or fewer lanes run
SHARE_MIN = 1024  # tokens: a range the client sends is shared among lanes only in pieces of at least this many
# (SmolLM2 l25 at 8192 tokens: pieces of 1,024-1,365 tokens beat contiguous lanes, pieces
# of 256-512 lose to them, since every piece of every chunk is one more step handed to a lane)


def one_torch_thread() -> None:
    """Run this thread's torch operations on one core (the initializer of every lane, and of the thread feeding them).
    torch.set_num_threads is also the count every thread started later begins with: start such threads inside
    ``torch_threads_kept``."""
    torch.set_num_threads(1)
    torch.ones(1 << 16).sum()  # a parallel region: this thread's count is its own now, not read again from the process


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """Threads started in this block may set their own torch thread count (one_torch_thread); after it, every thread
    started later begins with the count the caller has, as before. Start them here: an executor starts its thread at
    its first submit (``started``)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def started(executor: ThreadPoolExecutor) -> ThreadPoolExecutor:
    """``executor`` with its thread started (its initializer run) now."""
    executor.submit(int).result()
    return executor


Emitted = tuple[int, int, int, torch.Tensor, torch.Tensor]  # (target layer, start, end, K, V), as StreamingApplier's


class Lanes:
    """``parts`` worker threads, each running torch on one core; work given to one lane runs in the order given. One
    set serves every translation of a process: lanes interleave requests, they never run two steps at once."""

    def __init__(self, parts: int, min_slice: int = MIN_SLICE, share_min: int = SHARE_MIN):
        if parts < 1:
            raise ValueError(f"lanes need at least one part, got {parts}")
        self.parts, self.min_slice, self.share_min = parts, min_slice, share_min
        with torch_threads_kept():
            self.workers = [
                started(ThreadPoolExecutor(1, thread_name_prefix=f"kvferry-lane{i}", initializer=one_torch_thread))
                for i in range(parts)
            ]

    def applier(
        self, ms: MapSet, positions: int, out_dtype: torch.dtype | None, tokens: int, context: int
    ) -> LanedApplier | StreamingApplier:
        """A LanedApplier for one translation of ``tokens`` tokens (its arguments as StreamingApplier's). A translation
        too short for two lanes of ``min_slice`` tokens is mapped by the caller's thread (a StreamingApplier): one lane
        would add a hand-off and nothing to run beside it, and its output would leave whenever the lane got to it."""
        if self.parts_for(tokens) < 2:
            return StreamingApplier(ms, positions, out_dtype, tokens, context)
        return LanedApplier(ms, positions, out_dtype, tokens, context, self)

    def parts_for(self, tokens: int) -> int:
        """How many lanes a translation of ``tokens`` tokens runs in: each gets ``min_slice`` tokens or more."""
        return max(1, min(self.parts, tokens // self.min_slice))

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown(wait=True)


class LanedApplier:
    """StreamingApplier's ``push`` / ``drain`` over lanes. ``push`` validates the chunk, gives each lane its part and
    yields what the lanes have finished so far, without waiting for them; ``poll`` yields what they finished since;
    ``drain`` waits for all of it. A target layer's output leaves in token order: a segment's tokens wait for the
    segments before them. ``on_output``, when set, is called on a lane's thread each time a lane finishes output, so
    that a caller with nothing more to push (one waiting for the first target layer before it sends the rest) can
    ``poll``.

    Which tokens each lane maps is planned at the first chunk that reaches past token 0 (``plan``): the token range
    that chunk covers is taken as the size of the ranges the client sends, and every such range long enough to give
    each lane ``share_min`` tokens is cut among the lanes, so all lanes get work as soon as each range arrives (a
    client sending token range by token range, as kvferry's does, would otherwise leave a lane of contiguous halves
    idle until the second half of the upload). Shorter ranges give contiguous lanes. The plan decides only how the
    work is shared: chunks of any other size are cut along it and give the same answer."""

    maps_off_thread = True  # output may be finished after push returns: see on_output

    def __init__(
        self, ms: MapSet, positions: int, out_dtype: torch.dtype | None, tokens: int, context: int, lanes: Lanes
    ):
        self.ms, self.positions, self.out_dtype, self.tokens, self.context = ms, positions, out_dtype, tokens, context
        self._lanes = lanes
        self.segments: list[Segment] = []  # in token order, once planned
        self._ends: list[int] = []  # each segment's end, for bisect
        self._early: list[tuple[int, str, torch.Tensor, int]] = []  # context-only chunks pushed before the plan
        self._next: dict[tuple[int, str], int] = {}
        self._pending: list[deque[Future]] = [deque() for _ in range(lanes.parts)]
        self._ready: list[list[deque]] = []  # per segment, per target layer: finished, not yet yielded
        self._emitted = [0] * ms.target.geometry.layers
        self._closed = threading.Event()
        self.on_output: Callable[[], None] | None = None
        self.busy_seconds = [0.0] * lanes.parts  # per lane: time spent mapping

    def push(self, layer: int, kind: str, tensor: torch.Tensor, start: int = 0) -> Iterator[Emitted]:
        """Add source ``layer``'s K or V for tokens [start, start + T) (tensor [B, H, T, D]; see StreamingApplier)."""
        key = (layer, kind)
        check_push(self.ms, layer, kind, tensor, start, self._next.get(key, -self.context), self.tokens)
        end = start + tensor.shape[2]
        self._next[key] = end
        if not self.segments and end <= 0:  # only context so far: the plan waits for a chunk with tokens to map
            self._early.append((layer, kind, tensor, start))
            return
        if not self.segments:
            lanes = self._lanes
            self._start(plan(self.tokens, end, lanes.parts_for(self.tokens), lanes.share_min))
        self._give(layer, kind, tensor, start, end)
        yield from self._collect(wait=False)

    def _start(self, cuts: list[tuple[int, int, int]]) -> None:
        """Make a segment per planned (start, end, lane), and give them the chunks that came before the plan."""
        for a, b, lane in cuts:
            lane_context = self.context if a == 0 else min(self.ms.context, self.positions + a)
            self.segments.append(
                Segment(
                    a,
                    b,
                    lane,
                    a - lane_context,
                    StreamingApplier(self.ms, self.positions + a, self.out_dtype, b - a, lane_context),
                )
            )
            self._ready.append([deque() for _ in self._emitted])
        self._ends = [s.end for s in self.segments]
        for layer, kind, tensor, start in self._early:
            self._give(layer, kind, tensor, start, start + tensor.shape[2])
        self._early.clear()

    def _give(self, layer: int, kind: str, tensor: torch.Tensor, start: int, end: int) -> None:
        """Queue each segment's part of a chunk on its lane. Segments are in token order and so are their ``first``
        tokens (a later segment's context never starts before an earlier one's), so the segments a chunk reaches are
        those from the first ending past ``start`` until one whose reading starts at ``end`` or later: a long prompt's
        many segments are not walked for every chunk."""
        for j in range(bisect.bisect_right(self._ends, start), len(self.segments)):
            seg = self.segments[j]
            if seg.first >= end:
                break
            a, b = max(start, seg.first), min(end, seg.end)
            if a < b:
                part = tensor[:, :, a - start : b - start]
                future = self._lanes.workers[seg.lane].submit(self._map, j, layer, kind, part, a - seg.start)
                future.add_done_callback(self._finished)
                self._pending[seg.lane].append(future)

    def poll(self) -> Iterator[Emitted]:
        """What the lanes have finished since, without waiting."""
        yield from self._collect(wait=False)

    def drain(self) -> Iterator[Emitted]:
        """Wait for every lane's work on this translation; yield what it completed."""
        yield from self._collect(wait=True)

    def close(self) -> None:
        """The translation ended early: lanes skip its work still queued."""
        self._closed.set()

    def _map(self, j: int, layer: int, kind: str, part: torch.Tensor, start: int) -> tuple[int, list[Emitted]]:
        if self._closed.is_set():
            return j, []
        t0 = time.perf_counter()
        with torch.no_grad():
            out = list(self.segments[j].applier.push(layer, kind, part, start))
        self.busy_seconds[self.segments[j].lane] += time.perf_counter() - t0
        return j, out

    def _finished(self, future: Future) -> None:
        """A lane's step is done (a done-callback: ``poll`` now sees it): wake the caller if it made output or
        failed."""
        if self.on_output is not None and not future.cancelled() and (future.exception() or future.result()[1]):
            self.on_output()

    def _collect(self, wait: bool) -> Iterator[Emitted]:
        for pending in self._pending:
            while pending and (wait or pending[0].done()):
                j, out = pending.popleft().result()  # a lane's error is raised here
                first = self.segments[j].start
                for t, a, b, k, v in out:
                    self._ready[j][t].append((a + first, b + first, k, v))
        for t, done in enumerate(self._emitted):
            j = bisect.bisect_right(self._ends, done)  # the segment holding token ``done``
            while j < len(self.segments) and self._ready[j][t]:
                a, b, k, v = self._ready[j][t].popleft()
                yield t, a, b, k, v
                self._emitted[t] = done = b
                j = bisect.bisect_right(self._ends, done)

    @property
    def lane_seconds(self) -> float:
        """Map time off the calling thread: the busiest lane's (the lanes run at once)."""
        return max(self.busy_seconds)

    @property
    def emitted(self) -> int:
        """Tokens yielded for every target layer."""
        return min(self._emitted)

    @property
    def done(self) -> bool:
        return self.emitted >= self.tokens


class Segment(NamedTuple):
    """Tokens [start, end) of a translation, mapped on lane ``lane`` by ``applier``, which also reads the tokens from
    ``first`` (a windowed map's context before ``start``)."""

    start: int
    end: int
    lane: int
    first: int
    applier: StreamingApplier


def plan(tokens: int, first_range: int, parts: int, share_min: int = SHARE_MIN) -> list[tuple[int, int, int]]:
    """(start, end, lane) segments, in token order, for ``tokens`` tokens sent in ranges of ``first_range`` tokens:
    each range cut into up to ``parts`` segments of ``share_min`` tokens or more, each on the lane with the fewest
    tokens so far. One range for all, or ranges too short for two such segments, give ``parts`` contiguous lanes
    (``Lanes.parts_for`` decides ``parts``)."""
    if first_range >= tokens or first_range < 2 * share_min:
        return [(tokens * i // parts, tokens * (i + 1) // parts, i) for i in range(parts)]
    load, out = [0] * parts, []
    for s in range(0, tokens, first_range):
        e = min(s + first_range, tokens)
        p = max(1, min(parts, (e - s) // share_min))
        for i, lane in enumerate(sorted(range(parts), key=load.__getitem__)[:p]):
            a, b = s + (e - s) * i // p, s + (e - s) * (i + 1) // p
            out.append((a, b, lane))
            load[lane] += b - a
    return out
