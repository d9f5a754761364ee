"""Where a Translate's two cores go (issue 16, session 22): CPU time (both processes) per call of the
RPC, of the gRPC echo of its request bytes and of the map applied in-process, beside their wall times. The serial
bound adds the echo's and the map's wall times; the CPU bound divides the CPU time they need by the cores. A call whose
CPU time is near its two cores' worth of wall time is busy all along (the work costs more when it shares the cores);
one whose CPU time is well under it waits. Medians over ``--reps`` calls, taken in turn.

``--settle SECONDS`` idles before each timed call. Without it the RPC follows the in-process map directly, and torch's
OpenMP workers, which spin for a while after each parallel region, are charged to the client during the RPC (session
24, docs/benchmarks.md: a 2,048-token tiny call's client CPU read 16 ms, against 10 ms settled). The settled map
starts on a sleeping pool, so its wall time reads slower:

    .venv/bin/python scripts/research/cpu_bound.py --source models/S --target models/T --sizes 2048 8192 --reps 9
    .venv/bin/python scripts/research/cpu_bound.py --source models/S --target models/T --sizes 2048 8192 --reps 11 --settle 0.1
    .venv/bin/python scripts/research/cpu_bound.py --source models/pretrained/smollm2-135m-l25 \\
        --target models/pretrained/smollm2-135m --sizes 2048 --reps 7
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from sidecar_pair import load_pair, pair_arguments, translate_inputs  # scripts/research/sidecar_pair.py (beside this script)
from kvferry.bench.harness import ServerProcess
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.mappings.apply import apply

def process_cpu(pid: int) -> float:
    """Seconds on a CPU of process ``pid``'s live threads (their schedstat, in nanoseconds: /proc/<pid>/stat counts
    in 10 ms ticks, too coarse for a 30 ms call)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended
    return total / 1e9


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=9)
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds idle before each timed call, so that no earlier call's spinning threads are charged to it")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    source, target, ms, kw = load_pair(a)
    rows = []
    with ServerProcess(a.maps_dir, a.threads) as server, \
            TranslateClient(ClientOptions(target=server.address, timeout=300)) as client:
        for n in a.sizes:
            src, payloads = translate_inputs(source, target, ms, kw, client.options, n)
            calls = {"rpc": lambda: client.translate(src, ms.name, ms.version, **kw),
                     "echo": lambda: server.roundtrip(payloads),
                     "apply": lambda: torch.no_grad()(apply)(ms, src, 0)}
            seen = {k: {"wall_ms": [], "cpu_ms": [], "server_cpu_ms": []} for k in calls}
            for call in calls.values():
                call()  # warm-up
            for _ in range(a.reps):
                for name, call in calls.items():
                    time.sleep(a.settle)
                    c0, s0, t0 = own_cpu(), process_cpu(server.proc.pid), time.perf_counter()
                    call()
                    t1 = time.perf_counter()
                    seen[name]["wall_ms"].append((t1 - t0) * 1e3)
                    server_cpu = process_cpu(server.proc.pid) - s0
                    seen[name]["cpu_ms"].append((own_cpu() - c0 + server_cpu) * 1e3)
                    seen[name]["server_cpu_ms"].append(server_cpu * 1e3)
            med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in seen.items()}
            row = {"n": n, **{f"{k}_{m}": v for k, d in med.items() for m, v in d.items()}}
            for k in calls:
                row[f"{k}_client_cpu_ms"] = med[k]["cpu_ms"] - med[k]["server_cpu_ms"]  # medians' difference: a guide
            row["serial_bound_ms"] = med["echo"]["wall_ms"] + med["apply"]["wall_ms"]
            row["cpu_bound_ms"] = (med["echo"]["cpu_ms"] + med["apply"]["cpu_ms"]) / 2
            row["rpc_busy_share"] = med["rpc"]["cpu_ms"] / (2 * med["rpc"]["wall_ms"])
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print(f"\nmap {ms.name} {ms.version}; medians of {a.reps}; {a.settle} s idle before each call; CPU: both processes (the client's user + system, the server's threads on a CPU)\n")
    print("| n | RPC wall / CPU (server's) ms | echo wall / CPU (server's) ms | apply wall / CPU ms | serial bound ms | "
          "CPU bound (2 cores) ms | RPC cores busy | client CPU, RPC / echo ms |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['rpc_wall_ms']:.1f} / {r['rpc_cpu_ms']:.1f} ({r['rpc_server_cpu_ms']:.1f}) | "
              f"{r['echo_wall_ms']:.1f} / {r['echo_cpu_ms']:.1f} ({r['echo_server_cpu_ms']:.1f}) | "
              f"{r['apply_wall_ms']:.1f} / {r['apply_cpu_ms']:.1f} | {r['serial_bound_ms']:.1f} | {r['cpu_bound_ms']:.1f} | "
              f"{r['rpc_busy_share']:.0%} | {r['rpc_client_cpu_ms']:.1f} / {r['echo_client_cpu_ms']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
