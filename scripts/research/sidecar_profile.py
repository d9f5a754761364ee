"""Where a sidecar process spends a request's time: py-spy samples every thread of a bench sidecar while this process
calls it (tiny family's S__T map), then prints each thread's share of the samples and the busiest frames.

    .venv/bin/pip install py-spy        # research only, not a kvferry dependency
    .venv/bin/python scripts/research/sidecar_profile.py hit --tokens 8192 --calls 100 --out runs/results/profile_hit_8192.txt
    .venv/bin/python scripts/research/sidecar_profile.py translate --tokens 2048 --calls 100 --out runs/results/profile_translate_2048.txt

hit: key-only hits with every target block stored in a real redis-server; translate: the source KV streamed in.
--shm: the answers come through response regions (a folder on /dev/shm the sidecar and this client share).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, long_ids, published_prefix, shm_folder, tiny_pair
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.common.stores import RedisStore
from kvferry.mappings.capture import capture_kv

SECRET, BS = b"bench-secret", 256


def summary(raw: Path, top: int) -> str:
    """Per thread: share of samples not waiting (a frame other than the idle waits), and the busiest leaf frames."""
    threads, leaves = collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        threads[frames[0]] += int(count)
        leaves[(frames[0], frames[-1])] += int(count)
    idle = ("select (selectors.py", "_worker (concurrent/futures/thread.py", "Thread.run (threading.py")
    lines = []
    for thread, n in threads.most_common():
        busy = sum(c for (t, leaf), c in leaves.items() if t == thread and not leaf.startswith(idle) and
                   not any(i in leaf for i in idle))
        lines.append(f"{thread}: {n} samples, busy {busy / n:.0%}")
    lines.append("busiest frames (share of one thread's samples):")
    for (thread, leaf), c in leaves.most_common():
        if any(i in leaf for i in idle):
            continue
        lines.append(f"  {c / threads[thread]:5.1%}  {thread.split(':')[-1].strip()[:24]:24s} {leaf[:100]}")
        top -= 1
        if top == 0:
            break
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["hit", "translate"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shm", action="store_true", help="answers through response regions")
    a = ap.parse_args()
    spy_bin = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not spy_bin:
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
    torch.set_num_threads(2)
    ms, source, target = tiny_pair()
    redis_server = RedisServer() if a.what == "hit" else None
    extra = dict(redis_url=redis_server.url, prefix_secret=SECRET.decode(), prefix_block_size=BS) if redis_server else {}
    folder = shm_folder()
    shm = folder.name if a.shm else ""
    server = ServerProcess(paths.maps_dir(), shm_dir=shm, **extra)
    try:
        client = TranslateClient(ClientOptions(target=server.address, timeout=300, shm_dir=shm))
        if a.what == "hit":
            _, _, kw = published_prefix(source, target, ms, RedisStore(redis_server.url), SECRET, a.tokens, BS)
            call = lambda: client.translate(None, ms.name, ms.version, **kw)  # noqa: E731
        else:
            ids = long_ids(target.tokenizer, a.tokens)
            with torch.no_grad():
                src = capture_kv(source.model, ids[:, : a.tokens - 16])
            kw = dict(source_geometry=source.identity.geometry.fingerprint, tokenizer=source.identity.tokenizer)
            call = lambda: client.translate(src, ms.name, ms.version, **kw)  # noqa: E731
        for _ in range(5):
            call()
        a.out.parent.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen([spy_bin, "record", "--pid", str(server.proc.pid), "--format", "raw", "--threads", "--idle",
                                "--rate", "500", "-o", str(a.out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # py-spy attaches
        t0 = time.perf_counter()
        for _ in range(a.calls):
            call()
        wall = (time.perf_counter() - t0) / a.calls
        spy.send_signal(2)
        spy.wait(60)
        client.close()
    finally:
        server.close()
        folder.cleanup()
        if redis_server:
            redis_server.stop()
    print(f"{a.what}, {a.tokens} tokens: {wall * 1e3:.1f} ms a call while sampled ({a.calls} calls)")
    print(summary(a.out, a.top))


if __name__ == "__main__":
    main()
