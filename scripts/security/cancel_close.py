"""How a real `kvferry serve` counts callers that cancel and close their channel in the same instant.

Half the calls cancel mid-upload (the caller stalls after a few chunks), half mid-download (after the first block);
each caller then closes its channel at once, the case where gRPC may never tell the server about the cancel.
Prints the sidecar's `kvferry_requests_total` codes for Translate. Example:
    .venv/bin/python scripts/security/cancel_close.py --maps-dir maps --map S__T --calls 60
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import torch

from kvferry.client.client import encode_requests, make_spec
from kvferry.mappings.artifact import load
from kvferry.mappings.versions import version_key
from kvferry.v1 import translate_pb2_grpc as pb_grpc


def _serve(maps_dir: str) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvferry",
            "serve",
            "--maps-dir",
            maps_dir,
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--force-maps",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("kvferry serve exited before it reported its port")
        m = re.search(r"listening on [\d.]+:(\d+), metrics on :(\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, int(m.group(1)), int(m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maps-dir", required=True)
    ap.add_argument("--map", required=True)
    ap.add_argument("--calls", type=int, default=60)
    a = ap.parse_args()
    newest = max((p for p in (Path(a.maps_dir) / a.map).iterdir() if p.is_dir()), key=lambda p: version_key(p.name))
    g = load(newest).source.geometry

    def requests(tokens: int, chunk: int) -> list:
        kv = [tuple(torch.randn(1, g.kv_heads, tokens, g.head_dim) for _ in range(2)) for _ in range(g.layers)]
        return list(encode_requests(make_spec(kv, a.map), kv, chunk_tokens=chunk))

    small, big = requests(64, 16), requests(4096, 256)

    def stalls():
        yield from small[:5]
        time.sleep(3)  # the caller cancels while the sidecar waits for the rest

    proc, port, metrics_port = _serve(a.maps_dir)
    try:
        for i in range(a.calls):
            ch = grpc.insecure_channel(f"127.0.0.1:{port}", [("grpc.http2.bdp_probe", 0)])
            upload = i % 2 == 1
            call = pb_grpc.TranslateServiceStub(ch).Translate(stalls() if upload else iter(big), timeout=30)
            for _ in range(1 if upload else 2):
                next(call)  # the header (and the first block)
            if upload:
                time.sleep(0.1)  # the sidecar has read all that was sent, and waits for more
            call.cancel()
            ch.close()
        time.sleep(1.0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        counts = dict(re.findall(r'kvferry_requests_total\{code="(\w+)",method="Translate"\} ([\d.]+)', text))
        print(
            f"{a.calls} calls cancelled and closed at once ({a.calls // 2} mid-upload, {a.calls - a.calls // 2} "
            f"mid-download); Translate codes counted: {counts}"
        )
    finally:
        proc.kill()
        proc.wait(30)


if __name__ == "__main__":
    main()
