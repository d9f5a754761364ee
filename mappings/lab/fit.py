"""Fit a MapSet: capture both models' caches over a corpus, accumulate Gram sums, solve.

Shards across processes when torch.distributed is initialised (``torchrun … -m kvferry fit``):
each rank captures its share of the windows and the Gram sums are all-reduced before solving,
so the maps equal a single-process fit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifact import KINDS, MAX_WINDOW, Basis, LayerMap, MapSet
from ..errors import InvalidInput
from ..features import to_features, window_inputs
from ..geometry import Geometry, ModelIdentity, check_pair
from .capture import LoadedModel, capture_kv, corpus_digest, read_corpus, token_windows
from .gram import GramStats, all_reduce
from .reduced_rank import heldout_r2 as rr_heldout_r2
from .reduced_rank import reduced_rank
from .ridge import DEFAULT_LAMBDAS, SELECTIONS, RidgeSolver, rounding_variance, select_and_fit

DEFAULT_K = 4  # source layers per target map; see README "choosing k" for the measurement


@dataclass
class FitSettings:
    """How a map is fitted. Validated on construction."""

    k: int = DEFAULT_K
    """Source layers concatenated per target map, chosen greedily by held-out R²."""
    seq_len: int = 512
    """Calibration window length in tokens."""
    max_tokens: int | None = None
    """Stop reading the corpus after this many tokens (None: all of it)."""
    heldout_every: int = 5
    """Every n-th window is held out to choose lambda and source layers."""
    subsample: float = 1.0
    """Fraction of token positions kept per window (1.0 keeps all)."""
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS
    """Relative ridge strengths tried (times the mean eigenvalue of the centred Gram)."""
    batch: int = 4
    """Windows per forward pass."""
    seed: int = 0
    """Seed for position subsampling."""
    inputs: str = "kv"
    """Which source features feed a map: "kv" (each map reads the chosen layers' K and V) or "same" (K from K, V from
    V)."""
    per_head: bool = False
    """Block-diagonal maps: each target kv head reads only its corresponding source head."""
    min_gain: float = 0.0
    """Greedy selection stops adding source layers once the next would raise held-out R² by less than this (0: always
    k). A layer left out saves its share of the map's FLOPs on every translated token; where one source layer already
    reproduces the target layer (a shared or copied layer: R² 1.0), the map reads that layer alone."""
    selection: str = "greedy"
    """How each map's k source layers are chosen: "greedy" forward selection by held-out R² (the default), or
    "ranked": the k best layers on their own, far fewer eigendecompositions for wide models (docs/benchmarks.md)."""
    dtype: str = "float32"
    """Stored and applied dtype of the weights: "float32", or "bfloat16" (a third of the apply time on CPUs with
    native bf16; evaluate the bf16 map itself, since its evidence is what serving is gated on)."""
    window: int = 1
    """Tokens a windowed map reads per output token (t, t-1, ..., t-window+1); 1: every map is per-token. Where a
    shallow source loses long-range copying, keys read from a short window keep more of it (docs/real_pair.md)."""
    window_layers: tuple[int, int] | None = None
    """First and last target layer whose maps are windowed (None with window > 1: every target layer)."""
    window_kinds: str = "k"
    """Which of those layers' maps are windowed: "k" (the keys, where copying is lost) or "kv"."""
    basis_rank: int | None = None
    """A shared-basis set (:class:`kvferry.mappings.artifact.Basis`): every source layer's K and V coded into this many
    numbers per token, which every target map reads (reduced-rank regression, :mod:`kvferry.mappings.lab.reduced_rank`);
    None: each map reads its own k source layers. ``k`` and ``selection`` do not apply to it."""
    window_sources: int = 6
    """A windowed map reads the K and V of the source's last this-many layers (all, if it has fewer): one set for
    every windowed map, so one eigendecomposition solves them all. Greedy selection is not run for them: a window
    multiplies each candidate's width, and choosing among those would take hours."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise InvalidInput("k must be >= 1")
        if self.seq_len < 2:
            raise InvalidInput("seq_len must be >= 2")
        if self.heldout_every < 2:
            raise InvalidInput("heldout_every must be >= 2 (1 would hold out everything)")
        if not 0 < self.subsample <= 1:
            raise InvalidInput("subsample must be in (0, 1]")
        if not self.lambdas or any(l <= 0 for l in self.lambdas):
            raise InvalidInput("lambdas must be positive")
        if self.inputs not in ("same", "kv"):
            raise InvalidInput(f"inputs must be 'same' or 'kv', got {self.inputs!r}")
        if not 0 <= self.min_gain < 1:
            raise InvalidInput(f"min_gain must be in [0, 1), got {self.min_gain!r}")
        if self.selection not in SELECTIONS:
            raise InvalidInput(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise InvalidInput(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.window, int) or not 1 <= self.window <= MAX_WINDOW:
            raise InvalidInput(f"window must be an integer in 1..{MAX_WINDOW}, got {self.window!r}")
        if self.window_layers is not None:
            self.window_layers = tuple(self.window_layers)
            if len(self.window_layers) != 2 or not 0 <= self.window_layers[0] <= self.window_layers[1]:
                raise InvalidInput(
                    f"window_layers must be (first, last) target layers with 0 <= first <= last, "
                    f"got {self.window_layers!r}"
                )
        if self.window_kinds not in ("k", "kv"):
            raise InvalidInput(f"window_kinds must be 'k' or 'kv', got {self.window_kinds!r}")
        if self.window_sources < 1:
            raise InvalidInput(f"window_sources must be >= 1, got {self.window_sources!r}")
        if self.window == 1 and self.window_layers is not None:
            raise InvalidInput(
                f"window_layers {self.window_layers!r} names windowed maps but window is 1; "
                "set window (the tokens each reads) above 1"
            )
        if self.basis_rank is not None and (not isinstance(self.basis_rank, int) or self.basis_rank < 1):
            raise InvalidInput(f"basis_rank must be a positive integer, got {self.basis_rank!r}")
        if self.basis_rank is not None and (self.window > 1 or self.per_head or self.inputs != "kv"):
            raise InvalidInput(
                "a shared basis reads every source layer's K and V per token: drop window, per_head and "
                "inputs='same', or basis_rank"
            )
        if self.window > 1 and self.per_head:
            raise InvalidInput("per_head maps cannot be windowed: drop per_head or set window to 1")

    def inputs_for(self, kind: str) -> tuple[str, ...]:
        return (kind,) if self.inputs == "same" else KINDS

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "seq_len": self.seq_len,
            "max_tokens": self.max_tokens,
            "heldout_every": self.heldout_every,
            "subsample": self.subsample,
            "lambdas": list(self.lambdas),
            "seed": self.seed,
            "inputs": self.inputs,
            "per_head": self.per_head,
            **({"dtype": self.dtype} if self.dtype != "float32" else {}),
            **({"selection": self.selection} if self.selection != "greedy" else {}),
            **({"min_gain": self.min_gain} if self.min_gain else {}),
            **({"basis_rank": self.basis_rank} if self.basis_rank is not None else {}),
            **(self._window_dict() if self.window > 1 else {}),
        }

    def _window_dict(self) -> dict:
        return {
            "window": self.window,
            "window_layers": list(self.window_layers) if self.window_layers else None,
            "window_kinds": self.window_kinds,
            "window_sources": self.window_sources,
        }

    def window_plan(self, source: Geometry, target: Geometry) -> WindowPlan | None:
        """The windowed maps of a fit between these geometries (None: all per-token)."""
        if self.window == 1:
            return None
        first, last = self.window_layers or (0, target.layers - 1)
        if last >= target.layers:
            raise InvalidInput(
                f"window_layers ({first}, {last}) run past the target's {target.layers} layers "
                f"(0..{target.layers - 1}); pick layers the target has"
            )
        sources = tuple(range(max(0, source.layers - self.window_sources), source.layers))
        targets = tuple((t, kind) for t in range(first, last + 1) for kind in KINDS if kind in self.window_kinds)
        return WindowPlan(self.window, sources, targets)


@dataclass(frozen=True)
class WindowPlan:
    """The maps a fit makes windowed, and the source features they all read."""

    window: int
    sources: tuple[int, ...]
    targets: tuple[tuple[int, str], ...]  # (target layer, kind), in column order of the windowed sums' y side

    def x(self, feats: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """[T, inputs] of one sequence's all-layer features [T, 2*L*w] (layout of :func:`_all_features`)."""
        return window_inputs(lambda l, c: feats[:, feature_cols(geometry, l, c)], self.sources, KINDS, self.window)

    def y_cols(self, geometry: Geometry) -> torch.Tensor:
        return torch.cat([feature_cols(geometry, t, kind) for t, kind in self.targets])


def _all_features(kv, geometry, positions: torch.Tensor) -> torch.Tensor:
    """[B, T, 2*L*w]: every layer's position-free K, then every layer's V."""
    ks = [to_features(k, geometry.rope, positions) for k, _ in kv]
    vs = [to_features(v, None, positions) for _, v in kv]
    return torch.cat(ks + vs, dim=-1)


def feature_cols(geometry, layer: int, kind: str, head: int | None = None) -> torch.Tensor:
    """Columns of (layer, kind[, head]) in the layout of :func:`_all_features`."""
    start = (0 if kind == "k" else geometry.layers * geometry.kv_width) + layer * geometry.kv_width
    if head is not None:
        start += head * geometry.head_dim
        return torch.arange(start, start + geometry.head_dim)
    return torch.arange(start, start + geometry.kv_width)


@dataclass
class GramSet:
    """Train and held-out sums over all source and target layers, K and V side by side."""

    train: GramStats
    heldout: GramStats
    tokens: int = 0
    windows: int = 0
    windowed: GramSet | None = None
    """The windowed maps' sums: their inputs (:class:`WindowPlan`) against their target columns."""

    def all(self) -> list[GramStats]:
        return [self.train, self.heldout] + (self.windowed.all() if self.windowed else [])


class FeatureCache:
    """Each calibration window's captured features on disk (``<folder>/<pair>/<window sha256>.safetensors``, float32).

    A capture that is stopped resumes where it was (a window is written whole, by one rename), and refits whose
    capture settings differ (another window, subsample or seed) read the features instead of running both models.
    Files are keyed by both models' identities (weights included) and the window's token ids."""

    def __init__(self, folder: str | Path, source: ModelIdentity, target: ModelIdentity):
        from ..geometry import digest

        self.folder = Path(folder) / digest({"source": source.as_dict(), "target": target.as_dict(), "layout": 1})[:24]

    def _path(self, ids: torch.Tensor) -> Path:
        import hashlib

        return self.folder / (hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:32] + ".safetensors")

    def get(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        from safetensors.torch import load_file

        path = self._path(ids)
        if not path.is_file():
            return None
        t = load_file(str(path))
        if not torch.equal(t["ids"], ids.to(torch.int64)):
            return None
        return t["x"], t["y"]

    def put(self, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(ids)
        tmp = path.with_suffix(".tmp")
        save_file({"ids": ids.to(torch.int64).contiguous(), "x": x.contiguous(), "y": y.contiguous()}, str(tmp))
        os.replace(tmp, path)


def _window_features(
    source: LoadedModel, target: LoadedModel, ids: torch.Tensor, cache: FeatureCache | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per window of ``ids`` [B, T]: (x [T, dx], y [T, dy]), from the cache where it has them, else captured (and
    kept)."""
    sg, tg = source.identity.geometry, target.identity.geometry
    got = [cache.get(row) if cache else None for row in ids]
    todo = [i for i, g in enumerate(got) if g is None]
    if todo:
        pos = torch.arange(ids.shape[1])
        x = _all_features(capture_kv(source.model, ids[todo]), sg, pos)
        y = _all_features(capture_kv(target.model, ids[todo]), tg, pos)
        for row, i in enumerate(todo):
            got[i] = (x[row], y[row])
            if cache:
                cache.put(ids[i], x[row], y[row])
    return got


def accumulate(
    source: LoadedModel,
    target: LoadedModel,
    windows: list[torch.Tensor],
    settings: FitSettings,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
    features: str | Path | None = None,
) -> GramSet:
    sg, tg = source.identity.geometry, target.identity.geometry
    dx, dy = 2 * sg.layers * sg.kv_width, 2 * tg.layers * tg.kv_width
    gs = GramSet(GramStats(dx, dy), GramStats(dx, dy))
    plan = settings.window_plan(sg, tg)
    if plan:
        wdx, wdy = plan.window * len(plan.sources) * 2 * sg.kv_width, len(plan.targets) * tg.kv_width
        gs.windowed, ycols = GramSet(GramStats(wdx, wdy), GramStats(wdx, wdy)), plan.y_cols(tg)
    cache = FeatureCache(features, source.identity, target.identity) if features else None
    mine = list(range(rank, len(windows), world))
    gen = torch.Generator().manual_seed(settings.seed)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), desc="capture+gram", unit="win")
    for start in range(0, len(mine), settings.batch):
        idx = mine[start : start + settings.batch]
        ids = torch.stack([windows[i] for i in idx])
        feats = _window_features(source, target, ids, cache)
        keep = torch.rand(ids.shape, generator=gen) < settings.subsample if settings.subsample < 1.0 else None
        for row, i in enumerate(idx):
            held = i % settings.heldout_every == 0
            x, y = feats[row]
            xr, yr = (x, y) if keep is None else (x[keep[row]], y[keep[row]])
            (gs.heldout if held else gs.train).add(xr, yr)
            if plan:  # the window is cut from the whole sequence, before subsampling drops rows
                wx, wy = plan.x(x, sg), y[:, ycols]
                wx, wy = (wx, wy) if keep is None else (wx[keep[row]], wy[keep[row]])
                (gs.windowed.heldout if held else gs.windowed.train).add(wx, wy)
        gs.tokens += ids.numel()
        gs.windows += len(idx)
        if bar:
            bar.update(len(idx))
    if bar:
        bar.close()
    return gs


def solve_maps(
    gs: GramSet, source: ModelIdentity, target: ModelIdentity, settings: FitSettings, solver: RidgeSolver | None = None
) -> dict:
    sg, tg = source.geometry, target.geometry
    maps = _solve_windowed(gs.windowed, settings.window_plan(sg, tg), tg, settings) if gs.windowed else {}
    solver = solver or RidgeSolver(gs.train, gs.heldout)
    for t in range(tg.layers):
        for kind in KINDS:
            if (t, kind) in maps:
                continue
            inputs = settings.inputs_for(kind)
            blocks = {l: torch.cat([feature_cols(sg, l, c) for c in inputs]) for l in range(sg.layers)}
            chosen, fit = select_and_fit(
                gs.train,
                gs.heldout,
                feature_cols(tg, t, kind),
                blocks,
                settings.k,
                settings.lambdas,
                rounding_variance(settings.dtype),
                solver,
                settings.selection,
                settings.min_gain,
            )
            weight, bias, r2 = fit.weight, fit.bias, fit.heldout_r2
            if settings.per_head:
                weight, bias, r2 = _per_head(solver, sg, tg, t, kind, chosen, inputs, settings)
            dt = getattr(torch, settings.dtype)
            maps[(t, kind)] = LayerMap(t, kind, tuple(chosen), weight.to(dt), bias.to(dt), fit.lam, r2, inputs)
    return maps


def solve_basis(
    gs: GramSet,
    source: ModelIdentity,
    target: ModelIdentity,
    settings: FitSettings,
    solver: RidgeSolver | None = None,
    curve_ranks: tuple[int, ...] | None = None,
) -> tuple[dict, Basis, list[dict]]:
    """A shared-basis set of rank ``settings.basis_rank``: each target map's lambda by its every-source ridge path's
    held-out R² (one eigendecomposition serves all), then the reduced-rank projection on all rows.

    Also returns the cost/quality curve: per rank (``curve_ranks``, default powers of two and the chosen rank), the
    held-out R² of K and V (mean and worst target layer) of the projection fitted on the training rows, and its
    multiply-adds per token; the last row, ``rank`` None, is the every-source ridge map itself."""
    sg, tg = source.geometry, target.geometry
    solver = solver or RidgeSolver(gs.train, gs.heldout)
    top = min(gs.train.dx, gs.train.dy)
    if settings.basis_rank > top:
        raise InvalidInput(
            f"basis_rank {settings.basis_rank} exceeds the {top} features of the narrower side; pick a lower rank"
        )
    xi, keys = torch.arange(gs.train.dx), [(t, kind) for t in range(tg.layers) for kind in KINDS]
    blocks = [feature_cols(tg, t, kind) for t, kind in keys]
    lams, ridge_r2 = [], []
    for cols in blocks:
        path = solver.heldout_r2_path(xi, cols, settings.lambdas, rounding_variance(settings.dtype))
        best = int(torch.argmax(path))
        lams.append(settings.lambdas[best])
        if rounding_variance(settings.dtype):  # the curve's rows leave storage rounding out, and so does this one
            path = solver.heldout_r2_path(xi, cols, settings.lambdas)
        ridge_r2.append(float(path[best]))
    ranks = sorted({r for r in (curve_ranks or _powers_of_two(top)) if r <= top} | {settings.basis_rank})
    train_fit = reduced_rank(gs.train, blocks, lams, max(ranks))
    by_rank = rr_heldout_r2(train_fit, gs.train, gs.heldout, blocks, ranks)
    del train_fit
    curve = [_curve_row(r, by_rank[r], keys, gs.train.dx * r + r * gs.train.dy) for r in ranks]
    curve.append(_curve_row(None, ridge_r2, keys, gs.train.dx * gs.train.dy))
    fit = reduced_rank(solver.merged, blocks, lams, settings.basis_rank)
    dt = getattr(torch, settings.dtype)
    order = torch.cat([feature_cols(sg, l, c) for l in range(sg.layers) for c in KINDS])  # Basis.rows' layout
    basis = Basis(tuple(range(sg.layers)), fit.encoder[order].to(dt).contiguous(), fit.encoder_bias.to(dt), KINDS)
    r2 = dict(zip(keys, by_rank[settings.basis_rank]))
    maps = {
        key: LayerMap(
            key[0],
            key[1],
            basis.source_layers,
            fit.decoder[:, cols].to(dt).contiguous(),
            fit.decoder_bias[cols].to(dt),
            lam,
            r2[key],
            KINDS,
        )
        for key, cols, lam in zip(keys, blocks, lams)
    }
    return maps, basis, curve


def _powers_of_two(top: int) -> list[int]:
    return [1 << i for i in range(6, top.bit_length()) if 1 << i < top] + [top]


def _curve_row(rank: int | None, r2: list[float], keys: list[tuple[int, str]], macs: int) -> dict:
    by_kind = {kind: [v for (_, k), v in zip(keys, r2) if k == kind] for kind in KINDS}
    return {
        "rank": rank,
        "mflop_per_token": round(2 * macs / 1e6, 2),
        **{
            f"{kind}_r2_{stat}": round(f(v), 4)
            for kind, v in by_kind.items()
            for stat, f in (("mean", lambda v: sum(v) / len(v)), ("worst", min))
        },
    }


def _solve_windowed(gs: GramSet, plan: WindowPlan, tg: Geometry, settings: FitSettings) -> dict:
    """Every windowed map, each with its own lambda by held-out R²; they share one input set, so one solver."""
    solver, xi, dt = RidgeSolver(gs.train, gs.heldout), torch.arange(gs.train.dx), getattr(torch, settings.dtype)
    maps = {}
    for i, (t, kind) in enumerate(plan.targets):
        yi = torch.arange(i * tg.kv_width, (i + 1) * tg.kv_width)
        path = solver.heldout_r2_path(xi, yi, settings.lambdas, rounding_variance(settings.dtype))
        best = int(torch.argmax(path))
        w, b = solver.solve(xi, yi, settings.lambdas[best])
        maps[(t, kind)] = LayerMap(
            t, kind, plan.sources, w.to(dt), b.to(dt), settings.lambdas[best], float(path[best]), KINDS, plan.window
        )
    return maps


def _per_head(solver: RidgeSolver, sg, tg, t: int, kind: str, chosen: list[int], inputs, settings: FitSettings):
    """Block-diagonal variant: target head j reads source head j * Hs // Ht of the chosen layers."""
    rows = [(l, c) for l in chosen for c in inputs]
    weight = torch.zeros(len(rows) * sg.kv_width, tg.kv_width, dtype=torch.float64)
    bias = torch.zeros(tg.kv_width, dtype=torch.float64)
    r2s = []
    for j in range(tg.kv_heads):
        h = j * sg.kv_heads // tg.kv_heads
        xi = torch.cat([feature_cols(sg, l, c, h) for l, c in rows])
        yi = feature_cols(tg, t, kind, j)
        path = solver.heldout_r2_path(xi, yi, settings.lambdas, rounding_variance(settings.dtype))
        best = int(torch.argmax(path))
        w, b = solver.solve(xi, yi, settings.lambdas[best])
        for r, _ in enumerate(rows):
            weight[
                r * sg.kv_width + h * sg.head_dim : r * sg.kv_width + (h + 1) * sg.head_dim,
                j * tg.head_dim : (j + 1) * tg.head_dim,
            ] = w[r * sg.head_dim : (r + 1) * sg.head_dim]
        bias[j * tg.head_dim : (j + 1) * tg.head_dim] = b
        r2s.append(float(path[best]))
    return weight, bias, sum(r2s) / len(r2s)


def stats_key(source: ModelIdentity, target: ModelIdentity, corpus_sha256: str, settings: FitSettings) -> str:
    """What captured Gram sums depend on: both models, the corpus, and the capture settings (not k, lambdas, dtype)."""
    from ..geometry import digest

    capture = {
        k: v
        for k, v in settings.as_dict().items()
        if k
        in (
            "seq_len",
            "max_tokens",
            "heldout_every",
            "subsample",
            "seed",
            "window",
            "window_layers",
            "window_kinds",
            "window_sources",
        )
    }
    return digest({"source": source.as_dict(), "target": target.as_dict(), "corpus": corpus_sha256, "capture": capture})


def save_stats(gs: GramSet, path: str | Path, key: str) -> None:
    """Write captured sums (safetensors, float64) so that maps can be solved again without a forward pass."""
    from safetensors.torch import save_file

    tensors = {
        f"{side}.{name}": t.contiguous()
        for side, st in _sides(gs)
        for name, t in zip(("sx", "sy", "sxx", "sxy", "syy"), st.tensors())
    }
    meta = {"key": key, "tokens": str(gs.tokens), "windows": str(gs.windows)} | {
        f"{side}_n": str(st.n) for side, st in _sides(gs)
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_stats(path: str | Path, key: str) -> GramSet | None:
    """Sums written by :func:`save_stats` for the same models, corpus and capture settings; None if absent or stale."""
    from safetensors import safe_open

    if not Path(path).is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("key") != key:
            return None
        names = f.keys()  # a safe_open handle is not iterable itself
        t = {name: f.get_tensor(name) for name in names}

    def sides(prefix: str) -> list[GramStats]:
        out = []
        for side in (f"{prefix}train", f"{prefix}heldout"):
            sx, sy = t[f"{side}.sx"], t[f"{side}.sy"]
            out.append(
                GramStats(
                    sx.numel(),
                    sy.numel(),
                    int(meta[f"{side}_n"]),
                    sx,
                    sy,
                    t[f"{side}.sxx"],
                    t[f"{side}.sxy"],
                    t[f"{side}.syy"],
                )
            )
        return out

    windowed = GramSet(*sides("window.")) if "window.train.sx" in t else None
    return GramSet(*sides(""), int(meta["tokens"]), int(meta["windows"]), windowed)


def _sides(gs: GramSet) -> list[tuple[str, GramStats]]:
    """Named sums of a GramSet as saved: train, heldout, then the windowed maps' (prefixed "window.")."""
    named = [("train", gs.train), ("heldout", gs.heldout)]
    if gs.windowed:
        named += [("window.train", gs.windowed.train), ("window.heldout", gs.windowed.heldout)]
    return named


def fit_pair(
    source: LoadedModel,
    target: LoadedModel,
    corpus: list[str],
    settings: FitSettings | None = None,
    version: str = "1.0.0",
    progress: bool = True,
    stats_path: str | Path | None = None,
    features: str | Path | None = None,
) -> MapSet | None:
    """Fit source->target maps. Under torch.distributed every rank must call it; rank 0 gets the MapSet.

    ``stats_path``: reuse the Gram sums captured there for the same models, corpus and capture settings, or
    capture them and write them there (single process), so that refits (another k, lambda grid or dtype) skip
    both models' forward passes. ``features``: a folder of per-window captured features (:class:`FeatureCache`),
    read where present and written as captured, so a stopped capture resumes and other capture settings reuse it."""
    import torch.distributed as dist

    settings = settings or FitSettings()
    check_pair(source.identity, target.identity)
    settings.window_plan(source.identity.geometry, target.identity.geometry)  # a bad layer range fails before capture
    corpus_sha = corpus_digest(corpus)
    key = stats_key(source.identity, target.identity, corpus_sha, settings)
    gs = load_stats(stats_path, key) if stats_path else None
    processes, origin = 1, f" from saved sums {stats_path}"
    if gs is None:
        dist_on = dist.is_available() and dist.is_initialized()
        rank, processes = (dist.get_rank(), dist.get_world_size()) if dist_on else (0, 1)
        gs = _capture(source, target, corpus, settings, rank, processes, progress, features)
        if rank != 0:
            return None
        if stats_path and processes == 1:
            save_stats(gs, stats_path, key)
        origin = ""
    t0 = time.perf_counter()
    solver = RidgeSolver(gs.train, gs.heldout)
    fit_record, basis = settings.as_dict(), None
    if settings.basis_rank is not None:
        maps, basis, curve = solve_basis(gs, source.identity, target.identity, settings, solver)
        fit_record["rank_curve"] = curve
        if progress:
            print(format_curve(curve))
    else:
        maps = solve_maps(gs, source.identity, target.identity, settings, solver)
    if progress:
        print(
            f"solved {len(maps)} maps{origin} in {time.perf_counter() - t0:.1f}s ({solver.decompositions} "
            "eigendecompositions)"
        )
    calibration = {
        "corpus_sha256": corpus_sha,
        "tokens": gs.tokens,
        "windows": gs.windows,
        "seq_len": settings.seq_len,
        "processes": processes,
    }
    ms = MapSet(source.identity, target.identity, maps, version, fit_record, calibration, basis=basis)
    ms.validate()
    return ms


def format_curve(curve: list[dict]) -> str:
    """The shared basis' cost/quality curve as a table (``rank`` None: the every-source ridge map)."""
    lines = ["rank   MFLOP/token   held-out R² K mean / worst   V mean / worst"]
    for row in curve:
        name = "ridge" if row["rank"] is None else str(row["rank"])
        lines.append(
            f"{name:>6} {row['mflop_per_token']:>12.1f}   {row['k_r2_mean']:.3f} / {row['k_r2_worst']:.3f}"
            f"              {row['v_r2_mean']:.3f} / {row['v_r2_worst']:.3f}"
        )
    return "\n".join(lines)


def _capture(
    source: LoadedModel,
    target: LoadedModel,
    corpus: list[str],
    settings: FitSettings,
    rank: int,
    world: int,
    progress: bool,
    features: str | Path | None = None,
) -> GramSet:
    """Both models over the corpus' windows (this rank's share), sums all-reduced; tokens and windows are totals."""
    import torch.distributed as dist

    windows = token_windows(source.tokenizer, read_corpus(corpus), settings.seq_len, settings.max_tokens)
    if len(windows) < settings.heldout_every:
        raise InvalidInput(
            f"calibration corpus gives {len(windows)} windows of {settings.seq_len} tokens; "
            f"need at least {settings.heldout_every}. Add text or lower --seq-len."
        )
    gs = accumulate(source, target, windows, settings, rank, world, progress, features)
    all_reduce(gs.all())
    tokens = torch.tensor([float(gs.tokens)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(tokens)
    gs.tokens, gs.windows = int(tokens.item()), len(windows)
    return gs


def identity_mapset(model: ModelIdentity, version: str = "0.0.1") -> MapSet:
    """An exact map from a model to itself (W = I, b = 0): for layout and plumbing checks."""
    g = model.geometry
    maps = {
        (t, kind): LayerMap(t, kind, (t,), torch.eye(g.kv_width), torch.zeros(g.kv_width), 0.0, 1.0, (kind,))
        for t in range(g.layers)
        for kind in KINDS
    }
    target = ModelIdentity(model.name + "-self", g, model.tokenizer, model.weights)
    return MapSet(model, target, maps, version, {"kind": "identity"}, {})
