"""Session 16: a bfloat16 map multiplied in bfloat16 against the same map multiplied in float32, side by side in one
process (medians of --reps, the two taken in turn each round: harness.round_robin_ms), on this machine's CPU. On a CPU without AVX-512 torch
has no oneDNN bf16 GEMM, so precision.matmul_dtype multiplies bf16 maps in float32 there; this measures why.

Rows: one addmm of the l10 map's widest group shape, and apply() of each shipped real-pair map (latest version) on
--tokens source tokens. The largest difference between the two outputs is printed beside them, in bf16 ulps of
the layer's largest value.

    .venv/bin/python scripts/research/bf16_matmul_ab.py --json runs/results/bf16_matmul_ab.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kvferry.bench.harness import round_robin_ms, write_json
from kvferry.mappings import apply as apply_module
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.precision import fast_bf16

ROOT = Path(__file__).resolve().parents[2]


def _forced(compute: torch.dtype):
    """apply() with the map multiplied in ``compute`` whatever the CPU."""
    def run(ms, src):
        saved = apply_module.matmul_dtype
        apply_module.matmul_dtype = lambda map_dtype, device: compute
        try:
            return apply(ms, src, 0)
        finally:
            apply_module.matmul_dtype = saved
    return run


def _ulps(a: list, b: list) -> float:
    """Largest |a - b| over every layer, in bf16 ulps (2^-7 relative) of that layer's largest |value|."""
    return max(float((x - y).abs().max() / (2 ** -7 * y.abs().max())) for la, lb in zip(a, b) for x, y in zip(la, lb))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = {}

    def medians_s(calls: dict) -> dict:
        return {name: statistics.median(t) / 1e3 for name, t in round_robin_ms(calls, a.reps).items()}

    x, w, b = torch.randn(a.tokens, 1536, generator=g), torch.randn(1536, 960, generator=g), torch.randn(960, generator=g)
    med = medians_s({dt: (lambda dt=dt: torch.addmm(b.to(dt), x.to(dt), w.to(dt))) for dt in (torch.bfloat16, torch.float32)})
    rows[f"addmm {a.tokens}x1536 @ 1536x960"] = (med[torch.bfloat16], med[torch.float32], None)
    for root in sorted((ROOT / "maps").glob("smollm2-135m-l*__smollm2-135m")):
        ms = load(sorted(p.parent for p in root.glob("*/manifest.json"))[-1])
        sg = ms.source.geometry
        src = [tuple(torch.randn(1, sg.kv_heads, a.tokens, sg.head_dim, generator=g) for _ in range(2)) for _ in range(sg.layers)]
        forced = {dt: _forced(dt) for dt in (torch.bfloat16, torch.float32)}
        med = medians_s({dt: (lambda fn=fn: fn(ms, src)) for dt, fn in forced.items()})
        rows[f"apply {root.name} {ms.version} ({a.tokens} tokens)"] = (
            med[torch.bfloat16], med[torch.float32], _ulps(forced[torch.float32](ms, src), forced[torch.bfloat16](ms, src)))
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"CPU capability {cap}, fast bf16: {fast_bf16('cpu')}, {a.threads} threads\n")
    print("| what | bf16 ms | fp32 ms | bf16 / fp32 | max diff (bf16 ulps) |\n|---|---|---|---|---|")
    for what, (t_bf, t_fp, ulps) in rows.items():
        print(f"| {what} | {t_bf * 1e3:.1f} | {t_fp * 1e3:.1f} | {t_bf / t_fp:.1f} | {'' if ulps is None else f'{ulps:.2f}'} |")
    write_json(a.json, {"cpu_capability": cap, "fast_bf16": fast_bf16("cpu"), "threads": a.threads, "tokens": a.tokens,
                        "rows": {w: {"bf16_s": t_bf, "fp32_s": t_fp, "max_diff_bf16_ulps": u} for w, (t_bf, t_fp, u) in rows.items()}})


if __name__ == "__main__":
    main()
