"""The sidecar's one compute thread. Every call that touches tensor data runs on it; waits on I/O run elsewhere.

Why one thread for all of it, not only for the map: torch's intra-op pool (OpenMP) belongs to the thread that
enters a parallel region. Once any second thread has entered one (a copy of a large tensor is enough: loading a
map, casting or joining stored blocks), the compute thread's pool waits on futexes between regions, and every map
ran at about one core's speed: 13.9 ms against 7.7 ms for the tiny family at n = 2048 on 2 cores
(docs/benchmarks.md, session 11). Views of received bytes, slicing, numpy's copy of a tensor's data into a message,
and stored bytes sent as they are may run anywhere: they start no torch parallel region.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, ThreadPoolExecutor

THREAD_NAME = "kvferry-compute"


def compute_executor() -> ThreadPoolExecutor:
    """The executor of the one compute thread (one per sidecar)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)


async def on_compute(compute: Executor, fn, *args):
    """``fn(*args)`` on the compute thread, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(compute, fn, *args)
