"""Where the sidecar process's CPU goes during Translates (issue 16, session 22): ``perf record`` on the server process
(a real bench server, as in production) while the client sends ``reps`` translations, then read the file with
``perf report``. Needs perf and kernel.perf_event_paranoid <= 2:

    .venv/bin/python scripts/research/server_perf.py --source models/S --target models/T --sizes 2048 --reps 60 --out /tmp/perf_tiny.data
    perf report -i /tmp/perf_tiny.data --no-children --sort dso -g none
    .venv/bin/python scripts/research/server_perf.py --source models/pretrained/smollm2-135m-l25 \\
        --target models/pretrained/smollm2-135m --sizes 2048 --reps 10 --out /tmp/perf_l25.data

oneDNN's generated matmul kernels show as "[JIT] tid N"; the sidecar's Python as libpython; torch's elementwise work
(rotations, casts, copies) as libtorch_cpu; thread hand-offs as the kernel's scheduler and futex entries.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import time
from pathlib import Path

import torch

from sidecar_pair import load_pair, pair_arguments  # scripts/research/sidecar_pair.py (beside this script)
from kvferry.bench.harness import ServerProcess, long_ids
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.mappings.capture import capture_kv


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=60)
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvferry_server_perf.data"))
    a = ap.parse_args()
    source, target, ms, kw = load_pair(a)
    with ServerProcess(a.maps_dir, a.threads) as server, \
            TranslateClient(ClientOptions(target=server.address, timeout=300)) as client:
        caches = []
        for n in a.sizes:
            with torch.no_grad():
                caches.append(capture_kv(source.model, long_ids(target.tokenizer, n)[:, : n - 16]))
            for _ in range(3):  # warm-up
                client.translate(caches[-1], ms.name, ms.version, **kw)
        perf = subprocess.Popen(["perf", "record", "-F", "2000", "-g", "-p", str(server.proc.pid), "-o", str(a.out)],
                                stderr=subprocess.DEVNULL)
        time.sleep(1)  # perf attached
        for n, src in zip(a.sizes, caches):
            t0 = time.perf_counter()
            for _ in range(a.reps):
                client.translate(src, ms.name, ms.version, **kw)
            print(f"n={n}: {(time.perf_counter() - t0) / a.reps * 1e3:.1f} ms a call under perf", flush=True)
        perf.send_signal(signal.SIGINT)
        perf.wait()
    print(f"perf data: {a.out}")


if __name__ == "__main__":
    main()
