"""A translation's tokens cut into lanes: each lane maps its own token range through every layer on its own thread,
running torch on one core, and the lanes never wait for one another.

Why: torch's intra-op pool ends every operation at a barrier that waits for its slowest thread, and token slices of
each map step on several threads (session 20) still meet once a step. While transfers share the cores, a preempted
thread stalls every meeting. Lanes meet only where their outputs are joined, and the thread feeding them does not
wait for them. ``scripts/research/split_contention.py`` and ``translate_ab.py`` measure them against the others
(docs/benchmarks.md, sessions 20-21).

Maps are per token, so a lane needs only its own tokens' source features; a windowed map's lane also reads the
``context`` tokens before its first (pushed to it, read, never mapped), as any translation starting past position 0
does (apply.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import torch

from .apply import StreamingApplier, check_push
from .artifact import MapSet

MIN_SLICE = 128  # tokens: a lane gets at least this many, or fewer lanes run


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

    def __init__(self, parts: int, min_slice: int = MIN_SLICE):
        if parts < 1:
            raise ValueError(f"lanes need at least one part, got {parts}")
        self.parts, self.min_slice = parts, min_slice
        with torch_threads_kept():
            self.workers = [started(ThreadPoolExecutor(1, thread_name_prefix=f"kvferry-lane{i}",
                                                       initializer=one_torch_thread)) for i in range(parts)]

    def applier(self, ms: MapSet, positions: int, out_dtype: torch.dtype | None, tokens: int,
                context: int) -> LanedApplier | StreamingApplier:
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
    ``drain`` waits for all of it. A target layer's output leaves in token order: a lane's tokens wait for the lanes
    before them. ``on_output``, when set, is called on a lane's thread each time a lane finishes output, so that a
    caller with nothing more to push (one waiting for the first target layer before it sends the rest) can
    ``poll``."""

    maps_off_thread = True  # output may be finished after push returns: see on_output

    def __init__(self, ms: MapSet, positions: int, out_dtype: torch.dtype | None, tokens: int, context: int,
                 lanes: Lanes):
        parts = lanes.parts_for(tokens)
        self.ms, self.tokens, self.context, self._lanes = ms, tokens, context, lanes
        self.cuts = [tokens * i // parts for i in range(parts + 1)]
        self._firsts, self._subs = [], []  # per lane: the first token it reads (its context), its applier
        for i in range(parts):
            lane_context = context if i == 0 else min(ms.context, positions + self.cuts[i])
            self._firsts.append(self.cuts[i] - lane_context)
            self._subs.append(StreamingApplier(ms, positions + self.cuts[i], out_dtype, self.cuts[i + 1] - self.cuts[i],
                                               lane_context))
        self._next: dict[tuple[int, str], int] = {}
        self._pending: list[deque[Future]] = [deque() for _ in range(parts)]
        layers = ms.target.geometry.layers
        self._ready = [[deque() for _ in range(layers)] for _ in range(parts)]  # finished, not yet yielded
        self._emitted = [0] * layers
        self._closed = threading.Event()
        self.on_output: Callable[[], None] | None = None
        self.busy_seconds = [0.0] * parts  # per lane: time spent mapping

    def push(self, layer: int, kind: str, tensor: torch.Tensor, start: int = 0) -> Iterator[Emitted]:
        """Add source ``layer``'s K or V for tokens [start, start + T) (tensor [B, H, T, D]; see StreamingApplier)."""
        key = (layer, kind)
        check_push(self.ms, layer, kind, tensor, start, self._next.get(key, -self.context), self.tokens)
        end = start + tensor.shape[2]
        for i, sub in enumerate(self._subs):
            a, b = max(start, self._firsts[i]), min(end, self.cuts[i + 1])
            if a < b:
                part = tensor[:, :, a - start : b - start]
                future = self._lanes.workers[i].submit(self._map, i, layer, kind, part, a - self.cuts[i])
                future.add_done_callback(self._finished)
                self._pending[i].append(future)
        self._next[key] = end
        yield from self._collect(wait=False)

    def poll(self) -> Iterator[Emitted]:
        """What the lanes have finished since, without waiting."""
        yield from self._collect(wait=False)

    def drain(self) -> Iterator[Emitted]:
        """Wait for every lane's work on this translation; yield what it completed."""
        yield from self._collect(wait=True)

    def close(self) -> None:
        """The translation ended early: lanes skip its work still queued."""
        self._closed.set()

    def _map(self, i: int, layer: int, kind: str, part: torch.Tensor, start: int) -> list[Emitted]:
        if self._closed.is_set():
            return []
        t0 = time.perf_counter()
        with torch.no_grad():
            out = list(self._subs[i].push(layer, kind, part, start))
        self.busy_seconds[i] += time.perf_counter() - t0
        return out

    def _finished(self, future: Future) -> None:
        """A lane's step is done (a done-callback: ``poll`` now sees it): wake the caller if it made output or failed."""
        if self.on_output is not None and not future.cancelled() and (future.exception() or future.result()):
            self.on_output()

    def _collect(self, wait: bool) -> Iterator[Emitted]:
        for i, pending in enumerate(self._pending):
            while pending and (wait or pending[0].done()):
                for t, a, b, k, v in pending.popleft().result():  # a lane's error is raised here
                    self._ready[i][t].append((a + self.cuts[i], b + self.cuts[i], k, v))
        for t, done in enumerate(self._emitted):
            i = self._lane_of(done)
            while i is not None and self._ready[i][t]:
                a, b, k, v = self._ready[i][t].popleft()
                yield t, a, b, k, v
                self._emitted[t] = done = b
                i = self._lane_of(done)

    def _lane_of(self, token: int) -> int | None:
        """The lane whose tokens include ``token`` (None: past the last)."""
        for i in range(len(self._subs)):
            if token < self.cuts[i + 1]:
                return i
        return None

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
