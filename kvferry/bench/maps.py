"""``kvferry bench maps``: map variants side by side on the same held-out prompts.

Each variant is fitted on the calibration split and evaluated with the same settings, so the
table shows what k (source layers per map), the input features (K->K and V->V, or both from
both) and full-width vs per-head maps are worth on this pair.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvferry import paths
from kvferry.pretrained import model_path

VARIANTS = {
    "k1_same": dict(k=1, inputs="same"),
    "k2_same": dict(k=2, inputs="same"),
    "k4_same": dict(k=4, inputs="same"),
    "k4_same_per_head": dict(k=4, inputs="same", per_head=True),
    "k1_kv": dict(k=1, inputs="kv"),
    "k2_kv": dict(k=2, inputs="kv"),
    "k4_kv": dict(k=4, inputs="kv"),
    "k4_kv_per_head": dict(k=4, inputs="kv", per_head=True),
}


def run(a: argparse.Namespace) -> int:
    from kvferry.mappings.lab.capture import load_model
    from kvferry.mappings.lab.evaluate import EvalSettings, evaluate
    from kvferry.mappings.lab.fit import FitSettings, fit_pair
    from kvferry.quiet import quiet_transformers

    quiet_transformers()
    source, target = load_model(a.source), load_model(a.target)
    rows = {}
    settings = EvalSettings(prompts=a.prompts, greedy_prompts=0, recall_prompts=a.recall_prompts, refresh=a.refresh)
    for name in a.variants:
        ms = fit_pair(source, target, [str(c) for c in a.corpus], FitSettings(**VARIANTS[name]), progress=False)
        ev = evaluate(ms, source, target, [str(h) for h in a.heldout], settings, progress=False)
        r2 = [l["r2"] for l in ev["layers"]]
        rows[name] = {
            "heldout_r2_fit": sum(m.heldout_r2 for m in ms.maps.values()) / len(ms.maps),
            "eval_r2_mean": sum(r2) / len(r2),
            **{
                f"{arm}_{k}": v
                for arm in ("mapped", "mapped_refresh")
                for k, v in ev["arms"][arm].items()
                if k != "per_prompt"
            },
            "truncate_kl": ev["arms"]["truncate"]["kl"],
        }
        print(json.dumps({name: {k: round(v, 4) for k, v in rows[name].items()}}), flush=True)
    cols = [
        "eval_r2_mean",
        "mapped_top1",
        "mapped_top10",
        "mapped_kl",
        "mapped_attn_cos",
        "mapped_refresh_top1",
        "mapped_refresh_top10",
        "mapped_refresh_kl",
    ]
    print(f"\n{source.identity.name} -> {target.identity.name}; {a.prompts} held-out prompts; r={a.refresh}\n")
    print("| variant | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row.get(c, float('nan')):.3f}" for c in cols) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("maps", help="fit + evaluate map variants (k, inputs, per-head) side by side")
    b.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    b.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    b.add_argument("--corpus", nargs="+", default=[paths.data_file("calib.jsonl")])
    b.add_argument("--heldout", nargs="+", default=[paths.data_file("heldout.jsonl")])
    b.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    b.add_argument("--prompts", type=int, default=60)
    b.add_argument("--recall-prompts", type=int, default=0)
    b.add_argument("--refresh", type=int, default=16)
    b.add_argument("--json", default=None)
    b.set_defaults(func=run)
