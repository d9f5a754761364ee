"""``kvferry demo``: the main job end to end on the shipped family.

Fits S->T and S->T64 on the shipped calibration split, evaluates each on the held-out split,
writes the evidence into the artifacts, and prints the evidence tables.
"""

from __future__ import annotations

import argparse
import shutil

from kvferry import paths


def run(a: argparse.Namespace) -> int:
    from kvferry.cli import _quiet_transformers
    from kvferry.mappings.artifact import save, write_evidence
    from kvferry.mappings.capture import load_model
    from kvferry.mappings.evaluate import EvalSettings, evaluate, format_table
    from kvferry.mappings.fit import FitSettings, fit_pair
    from kvferry.mappings.gates import Gates

    _quiet_transformers()
    out = a.out / "maps"
    shutil.rmtree(out, ignore_errors=True)
    source = load_model(paths.model_dir("S"))
    for target_name in ("T", "T64"):
        target = load_model(paths.model_dir(target_name))
        print(f"== fit {source.identity.name} -> {target.identity.name} on data/calib.jsonl", flush=True)
        ms = fit_pair(source, target, [str(paths.data_file("calib.jsonl"))], FitSettings(), progress=not a.quiet)
        dest = save(ms, out)
        ev = evaluate(ms, source, target, [str(paths.data_file("heldout.jsonl"))],
                      EvalSettings(prompts=a.prompts, recall_prompts=min(a.prompts, 50)), progress=not a.quiet)
        write_evidence(dest, ev)
        print(format_table(ev, f"{ms.name} {ms.version}: evidence on held-out text ({a.prompts} prompts)"))
        problems = Gates().failures(ev)
        print("gates:", "PASS" if not problems else "FAIL: " + "; ".join(problems))
        print(f"artifact: {dest}\n", flush=True)
    return 0
