"""Issue 16, session 27: where each of the sidecar's threads spends a Translate, by py-spy's samples. Runs ``--reps``
Translate calls of ``--sizes[0]`` tokens against a sidecar process while ``py-spy record --threads`` samples it
(1,000 a second; ``--idle`` also counts waiting threads), then prints, per thread, its sample count and the frames
(the innermost kvferry frame and the innermost frame) with the most samples. A thread waiting for the GIL is counted at
the line it waits on. py-spy is not a kvferry dependency: ``pip install --target /tmp/pyspy py-spy`` and pass
``--py-spy /tmp/pyspy/bin/py-spy``:

    .venv/bin/python scripts/research/spy_translate.py --source models/S --target models/T --sizes 2048 --reps 60 --idle
    .venv/bin/python scripts/research/spy_translate.py --source models/pretrained/smollm2-135m-l25 \\
        --target models/pretrained/smollm2-135m --sizes 2048 --reps 12
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
import time
from pathlib import Path

from sidecar_pair import load_pair, pair_arguments, translate_inputs  # scripts/research/sidecar_pair.py (beside this script)
from kvferry.bench.harness import ServerProcess
from kvferry.client.client import ClientOptions, TranslateClient

OURS = ("sidecar/", "mappings/", "common/", "kvferry/")


def summary(raw: Path, top: int) -> None:
    """Print each thread's samples and its ``top`` (innermost kvferry frame | innermost frame) pairs."""
    per_thread: collections.Counter = collections.Counter()
    frames_of: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"_\d+$", "", frames[0].split(": ", 1)[-1])  # "thread (tid): name_0" -> name
        ours = [f for f in frames if any(p in f for p in OURS)]
        per_thread[thread] += int(count)
        frames_of[thread][(ours[-1] if ours else "-") + " | " + frames[-1]] += int(count)
    for thread, n in per_thread.most_common():
        print(f"{thread}: {n} samples")
        for where, k in frames_of[thread].most_common(top):
            print(f"  {k:6d}  {where[:200]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=60)
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--idle", action="store_true", help="count waiting threads' samples too")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    source, target, ms, kw = load_pair(a)
    raw = Path(tempfile.mkdtemp()) / "spy.txt"
    with ServerProcess(a.maps_dir.resolve(), a.threads) as server, \
            TranslateClient(ClientOptions(target=server.address, timeout=300)) as client:
        src, _ = translate_inputs(source, target, ms, kw, client.options, a.sizes[0])
        for _ in range(3):  # warm-up
            client.translate(src, ms.name, ms.version, **kw)
        spy = subprocess.Popen([a.py_spy, "record", "--pid", str(server.proc.pid), "--threads", "-r", "1000", "-f", "raw",
                                "-o", str(raw), *(["--idle"] if a.idle else [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)  # py-spy attaches
        for _ in range(a.reps):
            client.translate(src, ms.name, ms.version, **kw)
        spy.send_signal(2)  # SIGINT: py-spy writes its samples and exits
        spy.wait()
    summary(raw, a.top)


if __name__ == "__main__":
    main()
