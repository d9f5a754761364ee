"""Issue 16, session 25: what the servicer's request plumbing costs a message on the event loop alone (no gRPC, no
tensors): ``_with_wakes`` reads the next request while the current one is handled and interleaves WAKE when a lane
finishes output (two futures and an ``asyncio.wait`` a message); ``_before`` cuts the stream at its deadline. Each
over an async generator of ``--messages`` items. Then the hand-off every chunk makes to the compute thread and back
(``on_compute`` of a function that does nothing), on an idle machine:

    .venv/bin/python scripts/research/wake_cost.py --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvferry.sidecar.compute import ComputeThread, on_compute
from kvferry.sidecar.servicer import _before, _with_wakes


async def items(n: int):
    for i in range(n):
        await asyncio.sleep(0)  # a read that yields to the loop, as gRPC's does
        yield i


async def per_message(stream, n: int) -> float:
    t = time.perf_counter()
    async for _ in stream:
        pass
    return (time.perf_counter() - t) / n * 1e6


async def main(n: int) -> None:
    loop = asyncio.get_running_loop()
    bare = await per_message(items(n), n)
    rows = {"the generator alone": bare,
            "_with_wakes, no wake event (a map that never finishes off-thread)": await per_message(_with_wakes(items(n), None), n),
            "_with_wakes with a wake event (lanes)": await per_message(_with_wakes(items(n), asyncio.Event()), n),
            "_before (the stream deadline)": await per_message(_before(items(n), loop.time() + 3600), n)}
    print(f"\nµs a message, {n} messages, one event loop\n\n| path | µs | over the generator |\n|---|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} | {us - bare:+.1f} |")
    compute = ComputeThread(2)
    try:
        t = time.perf_counter()
        for _ in range(n):
            await on_compute(compute, int)
        print(f"\non_compute round trip (the event loop to the compute thread and back, nothing done): "
              f"{(time.perf_counter() - t) / n * 1e6:.1f} µs")
    finally:
        compute.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20000)
    asyncio.run(main(ap.parse_args().messages))
