"""The distillation corpus (data/distill_corpus.json): written from this Python's standard library by the command its
manifest names, byte for byte, and disjoint from every text the evaluation reads."""

import hashlib
import json
import subprocess
import sys

import pytest
from conftest import DATA, ROOT

MANIFEST = json.loads((DATA / "distill_corpus.json").read_text())


@pytest.mark.parametrize("part", ["code", "prose"])
def test_the_distillation_corpus_is_what_its_manifest_says(part, tmp_path):
    if sys.version_info[:3] != (3, 11, 7):
        pytest.skip("the manifest's digests are of CPython 3.11.7's standard library")
    want = MANIFEST["parts"][part]
    out = tmp_path / f"{part}.jsonl"
    args = want["command"].split()[1:]
    args[args.index("--out") + 1] = str(out)
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    blob = out.read_bytes()
    assert hashlib.sha256(blob).hexdigest() == want["sha256"]
    rows = [json.loads(line)["text"] for line in blob.decode().splitlines()]
    assert len(rows) == want["rows"] and sum(map(len, rows)) == want["chars"]
    splits = json.loads((DATA / "corpus.json").read_text())["splits"]
    assert not set(splits["train"]["paths"]) & (set(splits["heldout"]["paths"]) | set(splits["calib"]["paths"]))
    if part == "prose":  # nor is the evaluation's prose, the Language Reference, in it
        evaluated = "".join(
            json.loads(line)["text"] for line in (DATA / "prose_heldout.jsonl").read_text().splitlines()
        )
        probes = [r[i : i + 200] for r in rows for i in range(0, max(len(r) - 200, 1), 997)]
        assert sum(p in evaluated for p in probes) <= 0.01 * len(probes)
