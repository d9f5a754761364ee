"""A per-token step cut into token slices, one per thread, each thread running torch on one core.

Why: torch's intra-op pool (OpenMP) ends every operation at a barrier that waits for its slowest thread. When
something else shares the cores (the sidecar's transfer threads), a preempted pool thread stalls the whole operation,
and a map step is dozens of operations. Token slices on single-threaded workers meet once per step instead: measured
for the real pair's map at n = 2048 on 2 cores, with a process keeping 0.8 core busy beside it, 323-340 ms in two
slices against 531-697 ms on the two-thread pool, and alike (~190 ms) when the machine is idle
(docs/benchmarks.md, session 20). Maps are per token, so slices are independent and write disjoint outputs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import torch

MIN_SLICE = 128  # tokens: below this a hand-off costs more than the slice


def one_torch_thread() -> None:
    """Run this thread's torch operations on one core (a thread initializer for the workers of a split)."""
    torch.set_num_threads(1)


class TokenSplit:
    """Runs ``fn(a, b)`` over slices [a, b) covering [0, n): the first slice on the calling thread, the others at the
    same time on ``parts - 1`` helper threads. The caller should itself run torch on one thread
    (:func:`one_torch_thread`), or the slices fight its intra-op pool for the cores."""

    def __init__(self, parts: int, min_slice: int = MIN_SLICE):
        if parts < 1:
            raise ValueError(f"a token split needs at least one part, got {parts}")
        self.parts, self.min_slice = parts, min_slice
        self._helpers = (ThreadPoolExecutor(parts - 1, thread_name_prefix="kvferry-split", initializer=one_torch_thread)
                         if parts > 1 else None)

    def run(self, n: int, fn: Callable[[int, int], None]) -> None:
        parts = max(1, min(self.parts, n // self.min_slice))
        if parts == 1:
            fn(0, n)
            return
        cuts = [n * i // parts for i in range(parts + 1)]
        rest = [self._helpers.submit(fn, cuts[i], cuts[i + 1]) for i in range(1, parts)]
        try:
            fn(0, cuts[1])
        finally:
            wait(rest)  # the helpers write into the caller's tensors: never return while one still runs
        for f in rest:
            f.result()  # a helper's error, raised here

