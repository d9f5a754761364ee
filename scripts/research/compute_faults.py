"""Issue 16, session 18: minor page faults on the sidecar's compute thread per Translate (tiny pair), by step: the map's
fused matmul (torch.addmm), to_features / from_features (RoPE stripped and re-applied), the NaN/Inf check, the blocks'
encoding, and everything the thread does for a chunk (``flow._encoded``: add, and since session 21 poll and drain).
The sidecar process runs with ``--tunables`` as GLIBC_TUNABLES ("" for glibc's defaults):

    .venv/bin/python scripts/research/compute_faults.py --sizes 2048 8192 --reps 5 --json runs/results/compute_faults.json
    .venv/bin/python scripts/research/compute_faults.py --tunables glibc.malloc.hugetlb=1
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from hit_setup import bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import ServerProcess, long_ids, write_json
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.mappings.capture import capture_kv

COUNT = '''
import functools, json, os, resource
import kvferry.common.wire as w, kvferry.mappings.apply as ap, kvferry.sidecar.flow as fl, kvferry.sidecar.pipeline as pl
totals, out = {}, os.environ["KVFERRY_FAULTS_FILE"]
def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
def counted(mod, name, label, dump=False):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        f0 = faults()
        r = f(*a, **k)
        totals[label] = totals.get(label, 0) + faults() - f0
        if dump:
            with open(out, "w") as fh:
                json.dump(totals, fh)
        return r
    setattr(mod, name, g)
for mod, name in ((ap.torch, "addmm"), (ap, "to_features"), (ap, "from_features"), (pl, "all_finite"), (w, "encode_block_response")):
    counted(mod, name, name)
counted(fl, "_encoded", "all of a chunk's work", dump=True)
import kvferry.bench.server as s
s.main()
'''


def main() -> None:
    a = hit_args(sizes=(2048, 8192), reps=5, more=lambda ap: ap.add_argument("--tunables", default=""))
    ms, source, target = bench_pair()
    results = {"tunables": a.tunables}
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "faults.json"
        env = {"KVFERRY_FAULTS_FILE": str(dump), **({"GLIBC_TUNABLES": a.tunables} if a.tunables else {})}
        with ServerProcess(paths.maps_dir(), code=COUNT, env=env) as sc, \
                TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            for n in a.sizes:
                with torch.no_grad():
                    src = capture_kv(source.model, long_ids(target.tokenizer, n + 16)[:, :n])
                for _ in range(3):  # warm-up
                    client.translate(src, ms.name, ms.version)
                before = json.loads(dump.read_text())
                for _ in range(a.reps):
                    client.translate(src, ms.name, ms.version)
                after = json.loads(dump.read_text())
                results[n] = {k: (v - before.get(k, 0)) / a.reps for k, v in after.items()}
                print(f"n={n}, GLIBC_TUNABLES={a.tunables!r}: minor faults per Translate on the compute thread: "
                      + ", ".join(f"{k} {v:.0f}" for k, v in results[n].items()), flush=True)
    write_json(a.json, results)


if __name__ == "__main__":
    main()
