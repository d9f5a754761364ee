"""RSS of a real `kvferry serve` while callers send huge headers, round after round.

Four concurrent streams per round, each a single header of ``--ids`` token_ids (num_tokens equal, so only the size
limits can refuse it). Prints the server's RSS before, after each round and the peak. Example:
    .venv/bin/python scripts/security/header_rss.py --maps-dir maps --map smollm2-135m-l25__smollm2-135m --rounds 6
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time

import grpc

from kvferry.v1 import translate_pb2 as pb
from kvferry.v1 import translate_pb2_grpc as pb_grpc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maps-dir", required=True)
    ap.add_argument("--map", required=True)
    ap.add_argument("--ids", type=int, default=8_000_000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry", "serve", "--maps-dir", a.maps_dir, "--port", "0", "--force-maps"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    port = None
    while port is None:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("kvferry serve exited before it reported its port")
        m = re.search(r"listening on [\d.]+:(\d+)", line)
        port = int(m.group(1)) if m else None
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()

    def rss_mb() -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{proc.pid}/status").read()).group(1)) // 1024

    n = a.ids
    header = pb.TranslateRequest(
        header=pb.TranslateHeader(
            map=pb.MapRef(name=a.map, latest=True), num_tokens=n, token_ids=range(n), source_dtype=pb.DTYPE_FLOAT32
        )
    )
    print(
        f"header {header.ByteSize() / 2**20:.1f} MiB, {a.streams} at a time; server RSS before: {rss_mb()} MB",
        flush=True,
    )

    def one(out: list) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}", [("grpc.max_send_message_length", 64 << 20)]) as ch:
            try:
                list(pb_grpc.TranslateServiceStub(ch).Translate(iter([header]), timeout=120))
                out.append("OK")
            except grpc.RpcError as e:
                out.append(e.code().name)

    peak = 0
    try:
        for r in range(a.rounds):
            out: list = []
            threads = [threading.Thread(target=one, args=(out,)) for _ in range(a.streams)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak = max(peak, rss_mb())
                time.sleep(0.02)
            print(f"round {r}: {sorted(set(out))}; RSS after {rss_mb()} MB, peak so far {peak} MB", flush=True)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
