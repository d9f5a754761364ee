"""The sidecar's one compute thread. Every call that touches tensor data runs on it; waits on I/O run elsewhere.

Why one thread for all of it, not only for the map: torch's intra-op pool (OpenMP) belongs to the thread that
enters a parallel region. Once any second thread has entered one (a copy of a large tensor is enough: loading a
map, casting or joining stored blocks), the compute thread's pool waits on futexes between regions, and every map
runs at about one core's speed (`kvferry bench translate` shows it as apply in-process against the RPC).
Views of received bytes, slicing, numpy's copy of a tensor's data into a message,
and stored bytes sent as they are may run anywhere: they start no torch parallel region.

With ``map_threads`` > 1 (the default on a multi-core CPU) the compute thread runs torch on one core and a
translation's tokens are cut into that many lanes, each mapped through every layer on a lane thread of its own that
runs torch on one core (sidecar/lanes.py says why that beats torch's own pool while transfers share the cores). The
compute thread still orders all the work: it validates each chunk, hands each lane its part and sends what they
finished, without waiting for them.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, ThreadPoolExecutor

from kvferry.sidecar.lanes import Lanes, one_torch_thread, started, torch_threads_kept

THREAD_NAME = "kvferry-compute"


class ComputeThread(ThreadPoolExecutor):
    """The executor of the one compute thread (one per sidecar), with the lanes its translations are mapped on (None:
    the thread's own torch pool does the parallel work)."""

    def __init__(self, map_threads: int = 1):
        laned = map_threads > 1
        with torch_threads_kept():  # one core for these threads, not for every thread started after them
            super().__init__(
                max_workers=1, thread_name_prefix=THREAD_NAME, initializer=one_torch_thread if laned else None
            )
            if laned:
                started(self)
            self.lanes = Lanes(map_threads) if laned else None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait, cancel_futures=cancel_futures)
        if self.lanes is not None:
            self.lanes.shutdown()


async def on_compute(compute: Executor, fn, *args):
    """``fn(*args)`` on the compute thread, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(compute, fn, *args)
