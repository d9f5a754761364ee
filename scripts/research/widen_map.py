"""Give chosen maps of a set a wider window, computing exactly what they computed before (new inputs weigh zero).

Distillation then decides what the extra source tokens are worth: the widened set starts where the old one was.
`oracle_swaps.py` found the keys of target layers 15-19 are where the best l10 map still loses copying, so those
are the maps to widen. Example:

    .venv/bin/python scripts/research/widen_map.py --map runs/maps/smollm2-135m-l10__smollm2-135m/0.2.5 \
        --layers 15-21 --kind k --window 6 --save-version 0.2.8
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from kvferry.mappings.artifact import LayerMap, MapSet, load, save


def widened(m: LayerMap, window: int) -> LayerMap:
    """``m`` reading ``window`` tokens; the rows of the added offsets are zero (offsets are the outermost block)."""
    if window < m.window:
        raise SystemExit(f"map of layer {m.target_layer} {m.kind} already reads {m.window} tokens")
    per = m.weight.shape[0] // m.window
    weight = torch.cat([m.weight, m.weight.new_zeros((window - m.window) * per, m.weight.shape[1])])
    return dataclasses.replace(m, weight=weight.contiguous(), window=window, heldout_r2=float("nan"))


def widen(ms: MapSet, layers: range, kinds: str, window: int, version: str) -> MapSet:
    maps = dict(ms.maps)
    for layer in layers:
        for kind in kinds:
            maps[(layer, kind)] = widened(ms.maps[(layer, kind)], window)
    fit = dict(ms.fit) | {"widened": {"base_version": ms.version, "layers": [layers.start, layers.stop - 1],
                                      "kinds": kinds, "window": window, "script": "scripts/research/widen_map.py"}}
    return MapSet(ms.source, ms.target, maps, version, fit, dict(ms.calibration))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", type=Path, required=True)
    ap.add_argument("--layers", required=True, help="first-last target layer, e.g. 15-21")
    ap.add_argument("--kind", default="k", help="k, v or kv")
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--save-version", required=True)
    ap.add_argument("--save-to", type=Path, default=Path("runs/maps"))
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.layers.split("-"))
    print(f"wrote {save(widen(load(a.map), range(lo, hi + 1), a.kind, a.window, a.save_version), a.save_to)}")


if __name__ == "__main__":
    main()
