"""Fit a MapSet: capture both models' caches over a corpus, accumulate Gram sums, solve.

Shards across processes when torch.distributed is initialised (``torchrun … -m kvferry fit``):
each rank captures its share of the windows and the Gram sums are all-reduced before solving,
so the maps equal a single-process fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .artifact import KINDS, LayerMap, MapSet
from .capture import LoadedModel, capture_kv, corpus_digest, read_corpus, token_windows
from .errors import InvalidInput
from .features import to_features
from .geometry import ModelIdentity, check_pair
from .gram import GramStats, all_reduce
from .ridge import DEFAULT_LAMBDAS, select_and_fit

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

    def as_dict(self) -> dict:
        return {"k": self.k, "seq_len": self.seq_len, "max_tokens": self.max_tokens, "heldout_every": self.heldout_every,
                "subsample": self.subsample, "lambdas": list(self.lambdas), "seed": self.seed}


def _layer_features(kv, geometry, kind: str, positions: torch.Tensor) -> torch.Tensor:
    i = 0 if kind == "k" else 1
    spec = geometry.rope if kind == "k" else None
    return torch.cat([to_features(layer[i], spec, positions) for layer in kv], dim=-1)


@dataclass
class GramSet:
    """Train and held-out sums for K and V."""

    train: dict[str, GramStats] = field(default_factory=dict)
    heldout: dict[str, GramStats] = field(default_factory=dict)
    tokens: int = 0
    windows: int = 0

    def all(self) -> list[GramStats]:
        return [self.train[k] for k in KINDS] + [self.heldout[k] for k in KINDS]


def accumulate(source: LoadedModel, target: LoadedModel, windows: list[torch.Tensor], settings: FitSettings,
               rank: int = 0, world: int = 1, progress: bool = True) -> GramSet:
    sg, tg = source.identity.geometry, target.identity.geometry
    gs = GramSet()
    for kind in KINDS:
        gs.train[kind] = GramStats(sg.layers * sg.kv_width, tg.layers * tg.kv_width)
        gs.heldout[kind] = GramStats(sg.layers * sg.kv_width, tg.layers * tg.kv_width)
    mine = list(range(rank, len(windows), world))
    gen = torch.Generator().manual_seed(settings.seed)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), desc="capture+gram", unit="win")
    for start in range(0, len(mine), settings.batch):
        idx = mine[start : start + settings.batch]
        ids = torch.stack([windows[i] for i in idx])
        pos = torch.arange(ids.shape[1])
        skv, tkv = capture_kv(source.model, ids), capture_kv(target.model, ids)
        keep = None
        if settings.subsample < 1.0:
            keep = torch.rand(ids.shape, generator=gen) < settings.subsample
        for kind in KINDS:
            x, y = _layer_features(skv, sg, kind, pos), _layer_features(tkv, tg, kind, pos)
            for row, i in enumerate(idx):
                xr, yr = x[row], y[row]
                if keep is not None:
                    xr, yr = xr[keep[row]], yr[keep[row]]
                (gs.heldout if i % settings.heldout_every == 0 else gs.train)[kind].add(xr, yr)
        gs.tokens += ids.numel()
        gs.windows += len(idx)
        if bar:
            bar.update(len(idx))
    if bar:
        bar.close()
    return gs


def solve_maps(gs: GramSet, source: ModelIdentity, target: ModelIdentity, settings: FitSettings) -> dict:
    sg, tg = source.geometry, target.geometry
    maps = {}
    for t in range(tg.layers):
        for kind in KINDS:
            chosen, fit = select_and_fit(gs.train[kind], gs.heldout[kind], t, sg.kv_width, tg.kv_width,
                                         sg.layers, settings.k, settings.lambdas)
            maps[(t, kind)] = LayerMap(t, kind, tuple(chosen), fit.weight.float(), fit.bias.float(), fit.lam, fit.heldout_r2)
    return maps


def fit_pair(source: LoadedModel, target: LoadedModel, corpus: list[str], settings: FitSettings | None = None,
             version: str = "1.0.0", progress: bool = True) -> MapSet | None:
    """Fit source->target maps. Under torch.distributed every rank must call it; rank 0 gets the MapSet."""
    import torch.distributed as dist

    settings = settings or FitSettings()
    check_pair(source.identity, target.identity)
    windows = token_windows(source.tokenizer, read_corpus(corpus), settings.seq_len, settings.max_tokens)
    if len(windows) < settings.heldout_every:
        raise InvalidInput(f"calibration corpus gives {len(windows)} windows of {settings.seq_len} tokens; "
                           f"need at least {settings.heldout_every}. Add text or lower --seq-len.")
    dist_on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist_on else (0, 1)
    gs = accumulate(source, target, windows, settings, rank, world, progress)
    all_reduce(gs.all())
    tokens = torch.tensor([float(gs.tokens)], dtype=torch.float64)
    if dist_on:
        dist.all_reduce(tokens)
    if rank != 0:
        return None
    maps = solve_maps(gs, source.identity, target.identity, settings)
    calibration = {"corpus_sha256": corpus_digest(corpus), "tokens": int(tokens.item()), "windows": len(windows),
                   "seq_len": settings.seq_len, "processes": world}
    ms = MapSet(source.identity, target.identity, maps, version, settings.as_dict(), calibration)
    ms.validate()
    return ms


def identity_mapset(model: ModelIdentity, version: str = "0.0.1") -> MapSet:
    """An exact map from a model to itself (W = I, b = 0): for layout and plumbing checks."""
    g = model.geometry
    maps = {(t, kind): LayerMap(t, kind, (t,), torch.eye(g.kv_width), torch.zeros(g.kv_width), 0.0, 1.0)
            for t in range(g.layers) for kind in KINDS}
    target = ModelIdentity(model.name + "-self", g, model.tokenizer, model.weights)
    return MapSet(model, target, maps, version, {"kind": "identity"}, {})
