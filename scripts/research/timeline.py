"""What hit_timeline.py and translate_timeline.py share: the notes the sidecar's process writes (NOTES starts the code
it runs: ``note(name)`` and ``around(owner, name)``, which notes a method's start ">" and end "<"), and the timed
calls, each merged with the client's marks into one timeline."""

from __future__ import annotations

import json
import time
from pathlib import Path

# The start of the code run in the sidecar's process, before the bench server's main(): (step, monotonic time) lines
# in the file named by KVFERRY_TIMELINE.
NOTES = '''
import inspect, json, os, time
LOG = open(os.environ["KVFERRY_TIMELINE"], "a")
def note(name):
    LOG.write(json.dumps([name, time.perf_counter()]) + "\\n"); LOG.flush()
def around(owner, name):
    orig = getattr(owner, name)
    if inspect.isasyncgenfunction(orig):
        async def wrapped(*a, **k):
            note(name + ">")
            async for item in orig(*a, **k):
                yield item
            note(name + "<")
    elif inspect.iscoroutinefunction(orig):
        async def wrapped(*a, **k):
            note(name + ">"); r = await orig(*a, **k); note(name + "<"); return r
    else:
        def wrapped(*a, **k):
            note(name + ">"); r = orig(*a, **k); note(name + "<"); return r
    setattr(owner, name, wrapped)
'''


def timed_calls(call, log: Path, marks: list[tuple[str, float]], reps: int) -> list[list[tuple[str, float]]]:
    """``reps`` runs of ``call()``, each as its events sorted by time, (name, ms since the call began): the sidecar's
    notes read from ``log``, the (name, perf_counter) ``marks`` the client noted during the call, and its return."""
    calls = []
    for _ in range(reps):
        log.write_text("")
        marks.clear()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        time.sleep(0.02)  # the sidecar's last notes reach the file
        srv = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
        events = sorted(srv + marks + [("return", t1)], key=lambda e: e[1])
        calls.append([(name, (t - t0) * 1e3) for name, t in events])
    return calls
