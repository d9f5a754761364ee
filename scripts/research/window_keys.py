"""Keys of the late target layers from a short window of source tokens.

The diagnosis (docs/real_pair.md): with the 10-layer source, copying is lost in the *keys* of target layers
~10-24, which read what those layers' attention moved between positions (previous-token heads feed the induction
heads). A per-token map sees one position; this one reads W positions (t, t-1, ..., t-W+1) of the last few source
layers' position-free K and V, in one closed-form ridge solve per target layer (one shared eigendecomposition).

Arms, on fresh held-out copy-probe prompts (target recomputes the last 16 tokens in every mapped arm):
  full, truncate_16              the target alone
  l10                            the shipped map
  oracle_K                       the shipped map with the target's own keys for the replaced layers (the ceiling)
  window_W                       the shipped map with the replaced layers' keys from the window map
  window_W+attnP                 the window map fitted with each token's error weighted by the attention it receives
                                 in the target's replaced layers, to the power P (--attn-powers)

    .venv/bin/python scripts/research/window_keys.py --windows 1,2,4 --tokens 40000 --out runs/results/window_keys
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tables import write_results  # scripts/research/tables.py (beside this script)

from kvferry import paths
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import LayerMap, MapSet, load, save
from kvferry.mappings.cache import kv_slice
from kvferry.mappings.drift import QueryTap
from kvferry.mappings.features import from_features, to_features
from kvferry.mappings.lab.capture import capture_kv, load_model, read_corpus, token_stream, token_windows
from kvferry.mappings.lab.copy_probe import CopySettings, continuation_accuracy, make_examples

LAMBDAS = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)


def source_features(kv, layers: list[int], rope, window: int) -> torch.Tensor:
    """[T, window * len(layers) * 2 * width]: position-free K and V of ``layers`` at t, t-1, ... (zeros before 0)."""
    t = kv[0][0].shape[2]
    per = torch.cat(
        [
            torch.cat([to_features(kv[l][0], rope, range(t))[0], to_features(kv[l][1], None, range(t))[0]], -1)
            for l in layers
        ],
        -1,
    )
    shifted = [per]
    for w in range(1, window):
        shifted.append(torch.cat([torch.zeros(w, per.shape[1]), per[:-w]], 0))
    return torch.cat(shifted, -1)


def target_keys(kv, layers: list[int], rope) -> torch.Tensor:
    """[T, len(layers) * width]: position-free keys of the target ``layers``."""
    t = kv[0][0].shape[2]
    return torch.cat([to_features(kv[l][0], rope, range(t))[0] for l in layers], -1)


def fit(
    xs: list[torch.Tensor], ys: list[torch.Tensor], held: int, widths: int, ws: list[torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Ridge per output block of ``widths`` columns, lambda chosen on the last ``held`` sequences; float64 sums.
    ``ws``: a weight per token (mean 1): each row's squared error counts that much, in the fit and in the choice
    of lambda (R² is reported unweighted)."""
    xtr, ytr = torch.cat(xs[:-held]).double(), torch.cat(ys[:-held]).double()
    xho, yho = torch.cat(xs[-held:]).double(), torch.cat(ys[-held:]).double()
    wtr = torch.cat(ws[:-held]).double()[:, None] if ws else torch.ones(len(xtr), 1, dtype=torch.float64)
    who = torch.cat(ws[-held:]).double()[:, None] if ws else torch.ones(len(xho), 1, dtype=torch.float64)
    mx, my = (xtr * wtr).sum(0) / wtr.sum(), (ytr * wtr).sum(0) / wtr.sum()
    xc, yc = (xtr - mx) * wtr.sqrt(), (ytr - my) * wtr.sqrt()
    inputs, outputs = xtr.shape[1], ytr.shape[1]
    del xtr, ytr
    evals, evecs = torch.linalg.eigh(xc.T @ xc)
    proj = evecs.T @ (xc.T @ yc)  # [d, out]
    xh = (xho - mx) @ evecs
    best = [None] * (outputs // widths)
    for lam in LAMBDAS:
        scale = lam * float(evals.max()) * 1e-6
        pred = (xh / (evals + scale)) @ proj + my
        for b in range(len(best)):
            sl = slice(b * widths, (b + 1) * widths)
            err = (pred[:, sl] - yho[:, sl]) ** 2
            werr = float((err * who).sum())
            r2 = 1 - float(err.sum() / ((yho[:, sl] - yho[:, sl].mean(0)) ** 2).sum())
            if best[b] is None or werr < best[b][2]:
                best[b] = (r2, scale, werr)
    w = torch.empty(inputs, outputs, dtype=torch.float64)
    for b, (_, scale, _) in enumerate(best):
        sl = slice(b * widths, (b + 1) * widths)
        w[:, sl] = evecs @ (proj[:, sl] / (evals + scale)[:, None])
    bias = my - mx @ w
    return w.float(), bias.float(), [r2 for r2, _, _ in best]


def attention_received(tkv, queries: list[torch.Tensor], layers: list[int], cap: float, power: float) -> torch.Tensor:
    """[T] weight per token: the attention it receives in the target's ``layers`` (summed over the queries and
    heads that see it, each layer normalised to mean 1, averaged), to the power ``power``, capped at ``cap`` times
    the mean (attention sinks would otherwise own the fit), normalised to mean 1."""
    total = None
    for l in layers:
        k = tkv[l][0][0].float()  # [kv_heads, T, d], rotated as cached
        q = queries[l]  # [heads, T, d], rotated as the attention saw them
        g = q.shape[0] // k.shape[0]
        k = k.repeat_interleave(g, 0)
        t = k.shape[1]
        scores = (q @ k.transpose(1, 2)) / k.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        got = scores.softmax(-1).sum((0, 1))
        got = got / got.mean()
        total = got if total is None else total + got
    w = (total / len(layers)) ** power
    w = w.clamp(max=cap * float(w.mean()))
    return w / w.mean()


def windowed_mapset(
    base: MapSet,
    fitted: tuple[torch.Tensor, torch.Tensor],
    r2: list[float],
    s_layers: list[int],
    t_layers: list[int],
    window: int,
    version: str,
    settings: dict,
) -> MapSet:
    """``base`` with the keys of ``t_layers`` read from ``window`` tokens of ``s_layers``' K and V: a windowed map
    artifact (the column order of source_features is LayerMap's: offset, then layer, then K before V)."""
    w, b = fitted
    width = base.target.geometry.kv_width
    maps = dict(base.maps)
    for i, t in enumerate(t_layers):
        cols = slice(i * width, (i + 1) * width)
        maps[(t, "k")] = LayerMap(
            t,
            "k",
            tuple(s_layers),
            w[:, cols].contiguous().to(base.dtype),
            b[cols].contiguous().to(base.dtype),
            0.0,
            r2[i],
            ("k", "v"),
            window,
        )
    fit = dict(base.fit) | {
        "windowed_keys": {
            "target_layers": t_layers,
            "source_layers": s_layers,
            "window": window,
            "tokens": settings["tokens"],
            "script": "scripts/research/window_keys.py",
        }
    }
    return MapSet(base.source, base.target, maps, version, fit, dict(base.calibration))


def load_pair(path: Path):
    """The map artifact at ``path`` and the pretrained source and target it names (models/pretrained/)."""
    ms = load(path)
    return (
        ms,
        load_model(paths.model_dir("pretrained") / ms.source.name),
        load_model(paths.model_dir("pretrained") / ms.target.name),
    )


def heldout_examples(target, gaps: str, prompts: int, seed: int) -> list:
    """Fresh copy-probe prompts from the held-out split (``gaps`` as "500,1000")."""
    stream = token_stream(target.tokenizer, read_corpus([paths.data_file("heldout.jsonl")]))
    return make_examples(stream, CopySettings(gaps=tuple(int(g) for g in gaps.split(",")), prompts=prompts, seed=seed))


@torch.no_grad()
def score_key_arms(
    ms: MapSet, source, target, exs, t_layers: list[int], key_arms, r: int = 16
) -> dict[tuple[int, str], float]:
    """Per (gap, arm) the summed copy accuracy over ``exs``: full, truncate_16, the map ``ms`` (refresh r), the map
    with the target's own keys in ``t_layers`` (oracle_K), and the map with the keys of each arm ``key_arms(skv)``
    returns (name -> [T, len(t_layers) * kv width] position-free keys)."""
    tg = ms.target.geometry
    width, trope = tg.kv_heads * tg.head_dim, tg.rope
    sums: dict[tuple[int, str], float] = {}
    for ex in exs:
        n = len(ex.prompt)
        ids = torch.tensor([ex.prompt[:-1]])
        skv = capture_kv(source.model, ids)
        tkv = capture_kv(target.model, ids)
        mapped = apply(ms, skv, 0)
        row = {
            "full": continuation_accuracy(target.model, None, ex.prompt, ex.answer),
            "truncate_16": continuation_accuracy(target.model, None, ex.prompt[n - r :], ex.answer),
        }

        def with_keys(keys) -> list:
            out = [(k.float(), v.float()) for k, v in mapped]
            for i, l in enumerate(t_layers):
                out[l] = (keys[i], out[l][1])
            return out

        def score(kv) -> float:
            return continuation_accuracy(target.model, kv_slice(kv, 0, n - r), ex.prompt[n - r :], ex.answer)

        row["l10"] = score([(k.float(), v.float()) for k, v in mapped])
        row["oracle_K"] = score(with_keys([tkv[l][0] for l in t_layers]))
        t = ids.shape[1]
        for name, y in key_arms(skv).items():
            keys = [
                from_features(
                    y[None, :, i * width : (i + 1) * width].contiguous(), tg.kv_heads, trope, range(t)
                ).contiguous()
                for i in range(len(t_layers))
            ]
            row[name] = score(with_keys(keys))
        for k, v in row.items():
            sums[(ex.gap, k)] = sums.get((ex.gap, k), 0.0) + v
        print(ex.gap, {k: round(v, 3) for k, v in row.items()}, flush=True)
    return sums


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", type=Path, default=paths.maps_dir() / "smollm2-135m-l10__smollm2-135m" / "0.1.0")
    ap.add_argument("--source-layers", default="6,7,8,9")
    ap.add_argument("--target-layers", default="10-24")
    ap.add_argument("--windows", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gaps", default="500,1000")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--save-window",
        type=int,
        default=0,
        help="write the shipped map with this window's key maps as a windowed map artifact (0: none)",
    )
    ap.add_argument("--save-version", default="0.3.0")
    ap.add_argument("--save-to", type=Path, default=Path("runs/maps"))
    ap.add_argument(
        "--attn-powers",
        default="",
        help="extra arms: the window fits weighted by the attention each "
        "token receives in the target's replaced layers, to these powers (e.g. 0.5,1)",
    )
    ap.add_argument("--attn-cap", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=Path("runs/results/window_keys"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    ms, source, target = load_pair(a.map)
    s_layers = [int(x) for x in a.source_layers.split(",")]
    lo, hi = (int(x) for x in a.target_layers.split("-"))
    t_layers = list(range(lo, hi + 1))
    windows = [int(w) for w in a.windows.split(",")]
    srope, trope = ms.source.geometry.rope, ms.target.geometry.rope
    tg = ms.target.geometry
    width = tg.kv_heads * tg.head_dim

    seqs = token_windows(target.tokenizer, read_corpus([paths.data_file("calib.jsonl")]), a.seq, a.tokens)
    feats: dict[int, list[torch.Tensor]] = {w: [] for w in windows}
    ys: list[torch.Tensor] = []
    powers = [float(p) for p in a.attn_powers.split(",") if p]
    weights: dict[float, list[torch.Tensor]] = {p: [] for p in powers}
    for ids in seqs:
        tap = QueryTap(target.model, trope) if powers else None
        skv, tkv = capture_kv(source.model, ids[None]), capture_kv(target.model, ids[None])
        for w in windows:
            feats[w].append(source_features(skv, s_layers, srope, w))
        ys.append(target_keys(tkv, t_layers, trope))
        if tap is not None:
            qs = tap.queries(range(ids.shape[0]))
            tap.close()
            for p in powers:
                weights[p].append(attention_received(tkv, qs, t_layers, a.attn_cap, p))
    print(f"captured {len(seqs)} x {a.seq} tokens in {time.perf_counter() - t_start:.0f} s", flush=True)
    held = max(1, len(seqs) // 10)
    maps, r2s = {}, {}
    for w in windows:
        t0 = time.perf_counter()
        wt, b, r2 = fit(feats[w], ys, held, width)
        maps[w], r2s[w] = (wt, b), r2
        print(
            f"window {w}: {feats[w][0].shape[1]} inputs, held-out R2 per layer "
            + " ".join(f"{l}:{x:.3f}" for l, x in zip(t_layers, r2))
            + f" ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        for p in powers:
            t0 = time.perf_counter()
            wt, b, r2 = fit(feats[w], ys, held, width, weights[p])
            maps[f"{w}+attn{p:g}"], r2s[f"{w}+attn{p:g}"] = (wt, b), r2
            print(
                f"window {w}, attention-weighted (power {p:g}): held-out R2 per layer "
                + " ".join(f"{l}:{x:.3f}" for l, x in zip(t_layers, r2))
                + f" ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    del feats, ys
    if a.save_window:
        dest = save(
            windowed_mapset(
                ms, maps[a.save_window], r2s[a.save_window], s_layers, t_layers, a.save_window, a.save_version, vars(a)
            ),
            a.save_to,
        )
        print(f"wrote {dest}", flush=True)

    exs = heldout_examples(target, a.gaps, a.prompts, a.seed)

    def key_arms(skv) -> dict[str, torch.Tensor]:
        arms = {}
        for w in windows:
            x = source_features(skv, s_layers, srope, w)
            wt, b = maps[w]
            arms[f"window_{w}"] = x @ wt + b
            for p in powers:
                wt, b = maps[f"{w}+attn{p:g}"]
                arms[f"window_{w}+attn{p:g}"] = x @ wt + b
        return arms

    sums = score_key_arms(ms, source, target, exs, t_layers, key_arms)
    gaps = sorted({g for g, _ in sums})
    arms = list(dict.fromkeys(k for _, k in sums))
    result = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "seconds": time.perf_counter() - t_start,
        "heldout_r2": {str(w): dict(zip(map(str, t_layers), r2)) for w, r2 in r2s.items()},
        "gaps": {str(g): {k: sums[(g, k)] / a.prompts for k in arms} for g in gaps},
    }
    write_results(a.out, result, gaps, arms)


if __name__ == "__main__":
    main()
