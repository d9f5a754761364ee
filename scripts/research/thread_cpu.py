"""Which of the sidecar's threads a Translate's CPU goes to (issue 16, session 27), beside the same for the gRPC echo of
its request bytes: per call, the CPU of each thread of the sidecar process (schedstat) summed by role (the event loop,
the compute thread, the token lanes, gRPC's own threads, others) and the client's (rusage). The roles come from the
sidecar itself: the server process lists its threads' native ids and names into a file once it has started. Medians
over ``--reps`` calls of each, taken in turn:

    .venv/bin/python scripts/research/thread_cpu.py --source models/S --target models/T --sizes 2048 8192 --reps 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from cpu_bound import own_cpu  # scripts/research/cpu_bound.py (beside this script)
from sidecar_pair import load_pair, pair_arguments, translate_inputs  # scripts/research/sidecar_pair.py (beside this script)
from kvferry.bench.harness import ServerProcess
from kvferry.client.client import ClientOptions, TranslateClient

# Run in the server process: every 0.2 s, its Python threads' native ids and names into $KVFERRY_THREADS.
LIST_THREADS = '''
import json, os, threading, time
def _list():
    while True:
        names = {t.native_id: t.name for t in threading.enumerate()}
        with open(os.environ["KVFERRY_THREADS"] + ".tmp", "w") as f:
            json.dump(names, f)
        os.replace(os.environ["KVFERRY_THREADS"] + ".tmp", os.environ["KVFERRY_THREADS"])
        time.sleep(0.2)
threading.Thread(target=_list, name="thread-lister", daemon=True).start()
from kvferry.bench import server
server.main()
'''
ROLES = ("event loop", "compute thread", "lanes", "gRPC threads", "other")


def role(tid: int, pid: int, comm: str, names: dict[int, str]) -> str:
    name = names.get(tid, "")
    if tid == pid:
        return "event loop"  # the sidecar's asyncio loop runs on the main thread
    if name.startswith("kvferry-compute"):
        return "compute thread"
    if name.startswith("kvferry-lane"):
        return "lanes"
    if comm.startswith(("event_engine", "grpc")):
        return "gRPC threads"
    return "other"


def thread_cpu(pid: int) -> dict[int, tuple[str, int]]:
    """Per live thread of ``pid``: (comm, nanoseconds on a CPU)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = ((task / "comm").read_text().strip(), int((task / "schedstat").read_text().split()[0]))
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended
    return out


def by_role(before: dict, after: dict, pid: int, names: dict[int, str]) -> dict[str, float]:
    """Milliseconds of CPU per role between two ``thread_cpu`` readings."""
    ms = dict.fromkeys(ROLES, 0.0)
    for tid, (comm, ns) in after.items():
        ms[role(tid, pid, comm, names)] += (ns - before.get(tid, (comm, 0))[1]) / 1e6
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=15)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    source, target, ms, kw = load_pair(a)
    listing = Path(tempfile.mkdtemp()) / "threads.json"
    rows = []
    with ServerProcess(a.maps_dir.resolve(), a.threads, code=LIST_THREADS, env={"KVFERRY_THREADS": str(listing)}) as server, \
            TranslateClient(ClientOptions(target=server.address, timeout=300)) as client:
        pid = server.proc.pid
        for n in a.sizes:
            src, payloads = translate_inputs(source, target, ms, kw, client.options, n)
            calls = {"Translate": lambda: client.translate(src, ms.name, ms.version, **kw),
                     "echo": lambda: server.roundtrip(payloads)}
            for call in calls.values():  # warm-up
                call()
            time.sleep(0.5)
            names = {int(k): v for k, v in json.loads(listing.read_text()).items()}
            taken: dict[str, list[dict[str, float]]] = {c: [] for c in calls}
            for _ in range(a.reps):
                for c, call in calls.items():
                    s0, c0, t0 = thread_cpu(pid), own_cpu(), time.perf_counter()
                    call()
                    wall = (time.perf_counter() - t0) * 1e3
                    row = by_role(s0, thread_cpu(pid), pid, names)
                    taken[c].append({"wall": wall, **row, "client": (own_cpu() - c0) * 1e3})
            for c, per in taken.items():
                med = {k: statistics.median(p[k] for p in per) for k in per[0]}
                rows.append({"n": n, "call": c, **med})
                print(json.dumps({k: round(x, 2) if isinstance(x, float) else x for k, x in rows[-1].items()}), flush=True)
    print(f"\nmap {ms.name} {ms.version}; CPU ms a call by thread, medians of {a.reps} (Translate and echo in turn)\n")
    print("| n | call | wall ms | " + " | ".join(f"sidecar {r}" for r in ROLES) + " | client |")
    print("|---|---|---|" + "---|" * (len(ROLES) + 1))
    for r in rows:
        print(f"| {r['n']} | {r['call']} | {r['wall']:.1f} | " + " | ".join(f"{r[x]:.1f}" for x in ROLES) + f" | {r['client']:.1f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"map": ms.name, "version": ms.version, "reps": a.reps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
