"""``kvferry bench apply``: a map's in-process apply time, side by side with other maps and shared-basis ranks.

What a map costs per translated token depends on its kind and shape, not on its weights' values: each artifact
given is applied to the same random source cache of its pair's geometry, and so is a shared-basis set of each rank
in ``--basis-ranks`` with random weights of the first artifact's pair and dtype (its cost, before any such set is
fitted). Calls are taken in turn within each round (``round_robin_ms``), and each variant's ratio to the first
artifact is the median [quartiles] of the per-round ratios. The last column is what streaming can overlap: fed
one source layer's K or V at a time, in layer order (as a source prefill produces them), how many chunks arrive before
the first target layer leaves (a shared basis waits for all of them). No model is loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def synthetic_basis_set(ms, rank: int, seed: int = 0):
    """A shared-basis set of ``rank`` between ``ms``'s models, in its dtype, with random weights (for timing only)."""
    import torch

    from kvferry.mappings.artifact import KINDS, Basis, LayerMap, MapSet

    sg, tg = ms.source.geometry, ms.target.geometry
    g = torch.Generator().manual_seed(seed)
    rows = 2 * sg.layers * sg.kv_width
    basis = Basis(
        tuple(range(sg.layers)),
        (torch.randn(rows, rank, generator=g) / rows**0.5).to(ms.dtype),
        torch.zeros(rank, dtype=ms.dtype),
    )
    maps = {
        (t, kind): LayerMap(
            t,
            kind,
            basis.source_layers,
            (torch.randn(rank, tg.kv_width, generator=g) / rank**0.5).to(ms.dtype),
            torch.zeros(tg.kv_width, dtype=ms.dtype),
            inputs=KINDS,
        )
        for t in range(tg.layers)
        for kind in KINDS
    }
    return MapSet(ms.source, ms.target, maps, "0.0.0", {"basis_rank": rank}, {}, basis=basis)


def random_source_cache(geometry, n: int, seed: int = 0, dtype=None):
    """A random n-token source cache of ``geometry`` (per layer K and V [1, kv_heads, n, head_dim]): what an apply's
    cost is measured on (it does not depend on the values)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (1, geometry.kv_heads, n, geometry.head_dim)
    return [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(geometry.layers)
    ]


def first_layer_after(ms, kv) -> int:
    """Source chunks (one layer's K or V each, in layer order, as a source prefill produces them) pushed before the
    first target layer leaves the streaming applier: what a set's pipelining can overlap with the source's own work."""
    from kvferry.mappings.apply import StreamingApplier

    applier = StreamingApplier(ms, 0, tokens=kv[0][0].shape[2])
    pushes = 0
    for layer, (k, v) in enumerate(kv):
        for kind, x in (("k", k), ("v", v)):
            pushes += 1
            if any(True for _ in applier.push(layer, kind, x)):
                return pushes
    return pushes


def run(a: argparse.Namespace) -> int:
    import torch

    from kvferry.mappings.apply import apply
    from kvferry.mappings.artifact import load

    from .harness import paired_ratio, round_robin_ms, spread, write_json

    for flag, values in (("--basis-ranks", a.basis_ranks), ("--sizes", a.sizes), ("--reps", [a.reps])):
        if any(v < 1 for v in values):
            raise SystemExit(f"{flag} takes positive integers, got {values}")
    torch.set_num_threads(a.threads or torch.get_num_threads())
    variants = {f"{Path(p).parent.name}/{Path(p).name}": load(p) for p in a.maps}
    first = next(iter(variants.values()))
    for rank in a.basis_ranks:
        variants[f"basis r={rank} (random weights)"] = synthetic_basis_set(first, rank)
    sg = first.source.geometry
    for name, ms in variants.items():
        if ms.source.geometry.fingerprint != sg.fingerprint:
            raise SystemExit(f"{name} maps another source model ({ms.source.name}); give maps of one source geometry")
    results = {"threads": torch.get_num_threads(), "reps": a.reps, "sizes": {}}
    lines = [
        f"in-process apply, {first.source.name} -> {first.target.name}, {results['threads']} threads, medians of "
        f"{a.reps}",
        "",
        "| map | tokens | MFLOP per token | ms | ratio to the first, median [q1, q3] | first target layer after |",
        "|---|---|---|---|---|---|",
    ]
    for n in a.sizes:
        kv = random_source_cache(sg, n, seed=n)
        calls = {name: (lambda ms=ms: apply(ms, kv)) for name, ms in variants.items()}
        for fn in calls.values():  # warm-up: fused weights built, allocator settled
            fn()
        times = round_robin_ms(calls, a.reps)
        base = next(iter(calls))
        rows = {}
        for name, ms in variants.items():
            ratio = paired_ratio(times, (name,), (base,))
            ms_median = sorted(times[name])[len(times[name]) // 2]
            first = first_layer_after(ms, kv)
            rows[name] = {
                "ms": ms_median,
                "mflop_per_token": ms.flops_per_token / 1e6,
                "ratio_to_first": ratio,
                "first_target_layer_after_chunks": first,
                "chunks": 2 * sg.layers,
            }
            lines.append(
                f"| {name} | {n:,} | {rows[name]['mflop_per_token']:.1f} | {ms_median:.1f} | {spread(ratio)} | "
                f"{first} of {2 * sg.layers} source chunks |"
            )
        results["sizes"][str(n)] = rows
    print("\n".join(lines))
    write_json(a.json, results)
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("apply", help="in-process apply time of map artifacts and shared-basis ranks, side by side")
    b.add_argument(
        "maps",
        nargs="+",
        type=Path,
        help="map artifacts <root>/<pair>/<version> of one source model; the first is the reference of the ratios",
    )
    b.add_argument("--basis-ranks", type=int, nargs="*", default=[], help="also time shared-basis sets of these ranks")
    b.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    b.add_argument("--reps", type=int, default=7)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--json", default=None)
    b.set_defaults(func=run)
