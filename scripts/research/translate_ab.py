"""Issue 16 levers, side by side: the same Translate RPCs against sidecar processes that differ in one thing,
called in turn (round robin) so the machine's drift hits every variant alike.

Variants:
  protobuf_parse  source chunks parsed by protobuf (TranslateRequest.FromString, then a read of the data field);
                  the code before wire.decode_request read canonical chunks in place
  in_place        the shipped sidecar
  in_place+malloc the shipped sidecar with glibc's malloc told to keep freed memory (MALLOC_MMAP_THRESHOLD_,
                  MALLOC_TRIM_THRESHOLD_ raised): large buffers are then reused, not unmapped and faulted in again.
                  (Session 18: glibc ignores an mmap threshold above 32 MiB, so this variant only raised the trim
                  threshold, which also turns glibc's self-raising mmap threshold off: it faulted more, not less)
  malloc_keep     (session 18) glibc.malloc.mmap_threshold 32 MiB (its cap) and trim_threshold 1 GiB, as GLIBC_TUNABLES
  malloc_thp      (session 18) glibc.malloc.hugetlb=1: malloc's memory in transparent huge pages (one fault per 2 MiB)
  malloc_thp_keep (session 18) both
  in_place+passive the shipped sidecar with OMP_WAIT_POLICY=PASSIVE: torch's OpenMP workers sleep between
                  operations instead of spinning on cores the transfer needs
  buffered        the shipped sidecar, except that a request is received whole before any of it is mapped (no
                  overlap of the upload with the map: what the serial bound assumes)
  threads_1       the shipped sidecar mapping with one torch thread
  map_threads_1   (session 20) the sidecar as before session 20: the compute thread on torch's own pool, no token
                  slices (map_threads = 1); "in_place" maps in token lanes on single-threaded threads (session 21;
                  each map step cut in slices across them in session 20)
  switch_0.5ms    the shipped sidecar with Python's GIL switch interval at 0.5 ms (default 5 ms): does the compute
                  thread wait for the GIL behind the event loop's thread after each torch op?
  base            the sidecar as committed at --base (default HEAD), built into a temporary folder and run from it,
                  against the working tree's ("in_place"): what an uncommitted change to the sidecar gains
  scan_on_io_thread the sidecar before session 11: maps loaded on an asyncio.to_thread worker, whose torch copies
                  gave that thread an OpenMP pool of its own (the compute thread's regions then ran at one core's speed)

    .venv/bin/python scripts/research/translate_ab.py --source models/pretrained/smollm2-135m-l25 \\
        --target models/pretrained/smollm2-135m --sizes 2048 8192 --reps 9 --json runs/results/translate_ab.json

Each row also gives the response blocks a call and its CPU on both sides (the sidecar's threads from schedstat, the
client's rusage); a second table gives each variant's differences from the first one's, round by round (session 25).
``--map-threads N`` runs every sidecar with N token lanes unless its variant sets its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cpu_bound import own_cpu, process_cpu  # scripts/research/cpu_bound.py (beside this script)
from sidecar_pair import load_pair, pair_arguments  # scripts/research/sidecar_pair.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import ServerProcess, long_ids
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.mappings.capture import capture_kv

PROTOBUF_PARSE = ("import kvferry.common.wire as w, kvferry.v1.translate_pb2 as pb\n"
                  "w.decode_request = pb.TranslateRequest.FromString\n"
                  "import kvferry.bench.server as s\ns.main()\n")
BUFFERED = ("import kvferry.sidecar.servicer as sv\n"
            "stream = sv.TranslateServicer._translate_stream\n"
            "async def buffered(self, header, requests):\n"
            "    items = [r async for r in requests]\n"
            "    async def again():\n"
            "        for r in items:\n"
            "            yield r\n"
            "    async for out in stream(self, header, again()):\n"
            "        yield out\n"
            "sv.TranslateServicer._translate_stream = buffered\n"
            "import kvferry.bench.server as s\ns.main()\n")
SCAN_ON_IO_THREAD = ("import asyncio, kvferry.sidecar.server as srv\n"
                     "srv.Sidecar._scan = lambda self: asyncio.to_thread(self.registry.scan)\n"
                     "import kvferry.bench.server as s\ns.main()\n")
SWITCH = "import sys\nsys.setswitchinterval(0.0005)\nimport kvferry.bench.server as s\ns.main()\n"
SCAN_ON_IO_THREAD = ("import asyncio, kvferry.sidecar.server as srv\n"
                     "srv.Sidecar._scan = lambda self: asyncio.to_thread(self.registry.scan)\n"
                     "import kvferry.bench.server as s\ns.main()\n")
KEEP_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
MALLOC_KEEP = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
MALLOC_THP = "glibc.malloc.hugetlb=1"


def build_commit(rev: str, root: Path) -> str:
    """kvferry as committed at ``rev``, installed (not editable) under ``root``: the folder to put first on PYTHONPATH."""
    files = subprocess.run(["git", "archive", rev], check=True, capture_output=True, cwd=paths.repo_root()).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=files, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(root / "site"), str(root)], check=True)
    return str(root / "site")


VARIANTS = {"base": {}, "protobuf_parse": dict(code=PROTOBUF_PARSE), "in_place": {}, "in_place+malloc": dict(env=KEEP_MEMORY),
            "in_place+passive": dict(env={"OMP_WAIT_POLICY": "PASSIVE"}), "buffered": dict(code=BUFFERED),
            "threads_1": dict(threads=1), "map_threads_1": dict(map_threads=1), "switch_0.5ms": dict(code=SWITCH), "scan_on_io_thread": dict(code=SCAN_ON_IO_THREAD),
            "malloc_keep": dict(env={"GLIBC_TUNABLES": MALLOC_KEEP}), "malloc_thp": dict(env={"GLIBC_TUNABLES": MALLOC_THP}),
            "malloc_thp_keep": dict(env={"GLIBC_TUNABLES": f"{MALLOC_THP}:{MALLOC_KEEP}"})}


def paired(xs: list[float], ys: list[float]) -> str:
    """The round-by-round differences xs - ys as "median [q1, q3]"."""
    d = [x - y for x, y in zip(xs, ys)]
    q = statistics.quantiles(d, n=4) if len(d) > 1 else [d[0]] * 3
    return f"{statistics.median(d):+.1f} [{q[0]:+.1f}, {q[2]:+.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=9)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--chunk-tokens", type=int, default=0, help="0: as many as fill 2 MiB, as kvferry bench translate sends them")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--base", default="HEAD", help="the commit the variant 'base' runs")
    ap.add_argument("--map-threads", type=int, default=0,
                    help="the sidecars' token lanes (0: their default, one a core); a variant that sets its own keeps it")
    a = ap.parse_args()
    a.maps_dir = a.maps_dir.resolve()  # the base variant runs in another folder
    build = tempfile.TemporaryDirectory()  # the base variant's install, removed at the end
    if "base" in a.variants:
        site = build_commit(a.base, Path(build.name))
        VARIANTS["base"] = dict(env={"PYTHONPATH": site, "KVFERRY_HOME": str(paths.repo_root())}, cwd=site)
    source, target, ms, kw = load_pair(a)
    name = ms.name
    lanes = {"map_threads": a.map_threads} if a.map_threads else {}  # a variant's own setting wins
    servers = {v: ServerProcess(a.maps_dir, VARIANTS[v].get("threads", a.threads),
                                **{**lanes, **{k: x for k, x in VARIANTS[v].items() if k != "threads"}}) for v in a.variants}
    rows = []
    try:
        clients = {v: TranslateClient(ClientOptions(target=s.address, chunk_tokens=a.chunk_tokens, timeout=300)) for v, s in servers.items()}
        for n in a.sizes:
            with torch.no_grad():
                src = capture_kv(source.model, long_ids(target.tokenizer, n)[:, : n - 16])
            times: dict[str, list[float]] = {v: [] for v in a.variants}
            compute: dict[str, list[float]] = {v: [] for v in a.variants}
            blocks: dict[str, list[int]] = {v: [] for v in a.variants}
            cpu: dict[str, list[tuple[float, float]]] = {v: [] for v in a.variants}  # (sidecar, client) ms a call
            for v in a.variants:  # warm-up
                clients[v].translate(src, ms.name, ms.version, **kw)
            for _ in range(a.reps):
                for v in a.variants:
                    pid = servers[v].proc.pid
                    c0, s0, t = own_cpu(), process_cpu(pid), time.perf_counter()
                    res = clients[v].translate(src, ms.name, ms.version, **kw)
                    times[v].append((time.perf_counter() - t) * 1e3)
                    cpu[v].append(((process_cpu(pid) - s0) * 1e3, (own_cpu() - c0) * 1e3))
                    compute[v].append(res.stats.compute_seconds * 1e3)
                    blocks[v].append(res.stats.blocks)
            for v in a.variants:
                rows.append({"n": n, "variant": v, "median_ms": statistics.median(times[v]), "min_ms": min(times[v]),
                             "sidecar_compute_median_ms": statistics.median(compute[v]),
                             "blocks_median": statistics.median(blocks[v]),
                             "sidecar_cpu_median_ms": statistics.median(s for s, _ in cpu[v]),
                             "client_cpu_median_ms": statistics.median(c for _, c in cpu[v]), "times_ms": times[v],
                             "cpu_ms": cpu[v]})
                print(json.dumps({k: round(x, 1) if isinstance(x, float) else x for k, x in rows[-1].items() if k not in ("times_ms", "cpu_ms")}), flush=True)
        for c in clients.values():
            c.close()
    finally:
        for s in servers.values():
            s.close()
        build.cleanup()
    print(f"\nmap {name} {ms.version}; Translate RPC ms, {a.reps} rounds, variants called in turn; chunks of {a.chunk_tokens} tokens\n")
    print("| n | variant | RPC median ms | RPC min ms | sidecar compute median ms | response blocks, median | CPU a call, sidecar / "
          "client, medians ms |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['variant']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['sidecar_compute_median_ms']:.1f} | {r['blocks_median']:g} | "
              f"{r['sidecar_cpu_median_ms']:.1f} / {r['client_cpu_median_ms']:.1f} |")
    print(f"\nPer round, each variant minus {a.variants[0]} (same round): median [quartiles] ms\n")
    print("| n | variant | RPC | sidecar CPU | client CPU |\n|---|---|---|---|---|")
    first = {r["n"]: r for r in rows if r["variant"] == a.variants[0]}
    for r in rows:
        if r["variant"] != a.variants[0]:
            base = first[r["n"]]
            cells = [paired(r["times_ms"], base["times_ms"])] + [
                paired([c[i] for c in r["cpu_ms"]], [c[i] for c in base["cpu_ms"]]) for i in (0, 1)]
            print(f"| {r['n']} | {r['variant']} | " + " | ".join(cells) + " |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"map": name, "version": ms.version, "reps": a.reps, "chunk_tokens": a.chunk_tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
