"""``kvferry bench rollout``: is the free drift signal a usable proxy for quality?

Through the real path (a sidecar on loopback, the Cascade with shadow checks on every request), the
shipped map and copies of it with growing noise in its weights serve held-out prompts. Per request we
get the drift signal (no extra model compute) and the shadow check's KL against the target's own full
prefill. Reported: per noise level the means, and the correlation of drift with shadow KL, across all
requests and within the unmodified map (prompt-to-prompt variation only).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from kvferry import paths
from kvferry.pretrained import model_path


def pearson(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def spearman(xs: list[float], ys: list[float]) -> float:
    def rank(v):
        return {i: r for r, i in enumerate(sorted(range(len(v)), key=v.__getitem__))}

    rx, ry = rank(xs), rank(ys)
    return pearson([rx[i] for i in range(len(xs))], [ry[i] for i in range(len(ys))])


def run(a: argparse.Namespace) -> int:
    import torch

    from kvferry.client.cascade import Cascade
    from kvferry.client.client import ClientOptions, TranslateClient
    from kvferry.client.rollout import MapRollout
    from kvferry.mappings.artifact import load, save
    from kvferry.mappings.lab.capture import capture_kv, load_model, read_corpus, token_windows
    from kvferry.quiet import quiet_transformers
    from kvferry.sidecar.background import BackgroundSidecar
    from kvferry.sidecar.config import SidecarConfig

    quiet_transformers()
    source, target = load_model(a.source), load_model(a.target)
    name = f"{source.identity.name}__{target.identity.name}"
    base_dir = sorted((a.maps_dir / name).iterdir())[-1] if not a.version else a.maps_dir / name / a.version
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-rollout-"))
    versions = {}
    for i, sigma in enumerate(a.noise):
        ms = load(base_dir)
        g = torch.Generator().manual_seed(i)
        for m in ms.maps.values():
            scale = float(m.weight.float().std())
            m.weight = (m.weight.float() + sigma * scale * torch.randn(m.weight.shape, generator=g)).to(m.weight.dtype)
        ms.version = f"9.{i}.0"
        save(ms, tmp)
        versions[sigma] = ms.version
    texts = list(read_corpus([paths.data_file("heldout.jsonl")]))
    prompts = [w[None] for w in token_windows(target.tokenizer, texts, a.tokens)[: a.prompts]]
    never = dict(
        min_drift_attn_cos=-1.0, max_drift_rel_err=1e9, min_shadow_top10=-1.0, max_shadow_kl=1e9
    )  # measure, never switch off
    rows, samples = [], []
    with (
        BackgroundSidecar(SidecarConfig(maps_dir=str(tmp), port=0, reload_seconds=0, force_maps=True)) as sc,
        TranslateClient(ClientOptions(target=sc.address, timeout=120)) as client,
    ):
        for sigma, version in versions.items():
            rollout = MapRollout(
                version=version, refresh=a.refresh, min_tokens=a.refresh + 1, shadow_percent=100.0, **never
            )
            cascade = Cascade(target.model, client, name, rollout, source.identity)
            level = []
            for ids in prompts:
                with torch.no_grad():
                    src = capture_kv(source.model, ids)
                res = cascade.generate(ids, src, max_new_tokens=1)
                top1, top10, kl = res.shadow.result(120)
                level.append(
                    {
                        "noise": sigma,
                        "drift_attn_cos": res.drift.mean_attn_cos,
                        "drift_rel_err": res.drift.mean_rel_err,
                        "shadow_top1": float(top1),
                        "shadow_top10": top10,
                        "shadow_kl": kl,
                    }
                )
            cascade.close()
            samples += level

            def mean(k):
                return sum(s[k] for s in level) / len(level)

            rows.append(
                {
                    "noise": sigma,
                    **{
                        k: mean(k)
                        for k in ("drift_attn_cos", "drift_rel_err", "shadow_top1", "shadow_top10", "shadow_kl")
                    },
                }
            )

    def corr(sel, k):
        return (
            pearson([s[k] for s in sel], [s["shadow_kl"] for s in sel]),
            spearman([s[k] for s in sel], [s["shadow_kl"] for s in sel]),
        )

    clean = [s for s in samples if s["noise"] == a.noise[0]]
    out = {
        "map": name,
        "base_version": base_dir.name,
        "prompts": len(prompts),
        "tokens": a.tokens,
        "refresh": a.refresh,
        "levels": rows,
        "all": {k: dict(zip(("pearson", "spearman"), corr(samples, k))) for k in ("drift_attn_cos", "drift_rel_err")},
        "shipped_map_only": {
            k: dict(zip(("pearson", "spearman"), corr(clean, k))) for k in ("drift_attn_cos", "drift_rel_err")
        },
        "samples": samples,
    }
    lines = [
        f"map {name} {base_dir.name} + noise (x weight std); {len(prompts)} held-out prompts of {a.tokens} tokens; "
        f"r={a.refresh}",
        "",
        "| noise | drift attn cos | drift rel err | shadow top-1 | shadow top-10 | shadow KL |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['noise']:g} | {r['drift_attn_cos']:.4f} | {r['drift_rel_err']:.4f} | {r['shadow_top1']:.3f} | "
        f"{r['shadow_top10']:.3f} | {r['shadow_kl']:.4f} |"
        for r in rows
    ]
    lines += [
        "",
        "| correlation with shadow KL | all requests (Pearson / Spearman) | shipped map only (Pearson / Spearman) |",
        "|---|---|---|",
    ]
    for k in ("drift_attn_cos", "drift_rel_err"):
        lines.append(
            f"| {k} | {out['all'][k]['pearson']:+.2f} / {out['all'][k]['spearman']:+.2f} | "
            f"{out['shipped_map_only'][k]['pearson']:+.2f} / {out['shipped_map_only'][k]['spearman']:+.2f} |"
        )
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("rollout", help="correlation of the free drift signal with shadow-check KL")
    b.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    b.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    b.add_argument("--maps-dir", type=Path, default=paths.maps_dir())
    b.add_argument("--version", default="", help="base map version (default: the newest)")
    b.add_argument(
        "--noise",
        type=float,
        nargs="+",
        default=[0.0, 0.005, 0.01, 0.02, 0.04],
        help="noise levels added to the weights, in units of the weights' std; the first is the baseline",
    )
    b.add_argument("--prompts", type=int, default=40)
    b.add_argument("--tokens", type=int, default=256)
    b.add_argument("--refresh", type=int, default=16)
    b.add_argument("--json", default=None)
    b.set_defaults(func=run)
