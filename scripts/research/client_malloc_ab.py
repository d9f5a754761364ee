"""Issue 16, session 23: the Translate client's minor page faults, and glibc's malloc told to keep freed memory in the
client's process. Every call allocates the request messages, gRPC's copies of them and a bytes object per response
message; glibc hands large freed buffers back to the kernel, so the next call faults them in again and the kernel
zeroes each page (a perf profile of the client at 2,048 tokens: clear_page_erms a quarter of its CPU samples).

Each arm is a fresh process (the setting is process-wide) with its own bench sidecar left at glibc's defaults; the arms
alternate round by round. Per arm: the RPC's median wall time, the client's minor faults and CPU time per call (all
its threads), and the sidecar's minor faults per call:

    .venv/bin/python scripts/research/client_malloc_ab.py --rounds 4 --calls 100 --json runs/results/client_malloc_ab_s23.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ARM = r'''
import ctypes, json, resource, statistics, sys, time, torch
from kvferry.bench.harness import ServerProcess
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.mappings.artifact import load
maps, n, calls, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "keep"
if keep:  # mallopt(M_TRIM_THRESHOLD, 1 GiB), mallopt(M_MMAP_THRESHOLD, 32 MiB): buffers up to 32 MiB from a kept heap
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-1, 1 << 30) == 1 and libc.mallopt(-3, 32 << 20) == 1
ms = load(sys.argv[5])
g = ms.source.geometry
torch.manual_seed(0)
src = [(torch.randn(1, g.kv_heads, n, g.head_dim), torch.randn(1, g.kv_heads, n, g.head_dim)) for _ in range(g.layers)]
kw = dict(source_geometry=g.fingerprint, tokenizer=ms.source.tokenizer)
def server_faults(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])
with ServerProcess(maps, 2) as srv, TranslateClient(ClientOptions(target=srv.address, timeout=300)) as client:
    for _ in range(5):
        client.translate(src, ms.name, ms.version, **kw)
    f0, c0, s0, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), server_faults(srv.proc.pid), []
    for _ in range(calls):
        t0 = time.perf_counter()
        client.translate(src, ms.name, ms.version, **kw)
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"rpc_ms": statistics.median(times),
                      "client_faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls,
                      "client_cpu_ms": (time.process_time() - c0) / calls * 1e3,
                      "server_faults": (server_faults(srv.proc.pid) - s0) / calls}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--maps-dir", default="maps")
    ap.add_argument("--map", default="maps/S__T/1.1.0")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = {"default": [], "keep": []}
    for r in range(a.rounds):
        for arm in runs:
            out = subprocess.run([sys.executable, "-c", ARM, a.maps_dir, str(a.tokens), str(a.calls), arm, a.map],
                                 capture_output=True, text=True, check=True)
            runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[arm][-1].items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"map": a.map, "tokens": a.tokens, "calls": a.calls, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
