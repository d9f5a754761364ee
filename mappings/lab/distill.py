"""Distil a map set through the frozen target, on the objective the evidence and the gate score.

The closed form fits each map to the target's K or V by squared error, and squared error is not what the target
needs (a better R² repeatedly meant worse long-range copying on the real pair). What the gate's ``mapped_refresh``
arm measures is this: the target computes the last tokens of a prompt on top of the mapped cache. Distillation
trains the maps of target layers >= ``from_layer`` (K and V, windowed or per-token, whatever the set holds) so that
the target's next-token distributions over such a tail match its own full prefill's: KL(full ‖ mapped) on the
tail's logits, back-propagated through the frozen target into the maps' weights. The target is not changed and
does not run at translation time: the result is an ordinary map set, judged by ``kvferry eval`` like any other.

Every other training window ends with a repeat of an earlier stretch of itself, so the tail's induction heads must
find the first occurrence inside the mapped prefix (copying is what a map must carry over long distances).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..apply import apply
from ..artifact import Basis, CodeMLP, LayerMap, MapSet
from ..cache import LayerKV, to_dynamic_cache
from ..errors import InvalidInput
from ..features import from_features, to_features, window_inputs
from ..precision import autocast, check_precision
from .capture import capture_kv

REF_TOP_K = 64
"""Tokens per tail position whose full-prefill log-probability a reference keeps (the rest's mass is kept as one)."""


@dataclass(frozen=True)
class DistillSettings:
    """How a map set is distilled through its target."""

    from_layer: int = 0
    """Train the maps of this target layer and above; the layers below keep the set's weights."""
    tail: int = 48
    """Tokens the target computes on top of the mapped prefix; the loss is over their next-token distributions."""
    tails: int = 1
    """Tails per training window, ending at equal steps through it (2: mid-window and at its end)."""
    repeat_span: int = 160
    """Every other window's last ``repeat_span`` tokens repeat an earlier stretch of it (0: no repeats)."""
    epochs: int = 3
    """Passes over the training tails; the epoch with the lowest held-out KL is kept (epoch 0: the starting map)."""
    lr: float = 5e-5
    """Adam's peak learning rate (one-cycle schedule, 10% warm-up)."""
    seed: int = 0
    """Seeds the repeats and the order of the tails."""
    temperature: float = 1.0
    """The training loss is the KL at this temperature (both distributions softened, times T², as in knowledge
    distillation): above 1 it weighs how the less likely tokens rank, which the gate's top-10 overlap reads. The
    held-out KL that picks the epoch is always at temperature 1, the evidence's."""
    ref_top_k: int = REF_TOP_K
    """Tokens per tail position whose full-prefill log-probability a reference (:class:`TailRef`) keeps."""
    train_precision: str = "float32"
    """The training steps' and the held-out KL's forwards: ``float32``, or ``bfloat16`` autocast (the maps' weights,
    the optimiser and the loss stay in float32)."""
    capture_precision: str = "float32"
    """The capture's two forwards (the target's reference and the source's cache): ``float32``, or ``bfloat16``
    (autocast; about 4x faster on CPUs with bf16 matrix units). On the Qwen pair the 1.5B's bf16-autocast tail
    distributions differ from its fp32 ones by a KL of 3e-5 on average (7e-4 at most) with the same top-1, three orders
    below a distillation's loss, so references from either serve one training run; each file records its precision."""

    def __post_init__(self) -> None:
        if self.from_layer < 0:
            raise InvalidInput(f"from_layer must be >= 0, got {self.from_layer}")
        if self.tail < 1 or self.tails < 1:
            raise InvalidInput(f"tail and tails must be >= 1, got {self.tail} and {self.tails}")
        if not self.temperature > 0:
            raise InvalidInput(f"temperature must be > 0, got {self.temperature}")
        if not isinstance(self.ref_top_k, int) or self.ref_top_k < 1:
            raise InvalidInput(f"ref_top_k must be a positive number of tokens, got {self.ref_top_k!r}")
        check_precision("capture_precision", self.capture_precision)
        check_precision("train_precision", self.train_precision)
        if self.repeat_span < 0 or self.epochs < 0 or not self.lr > 0:
            raise InvalidInput(
                f"repeat_span and epochs must be >= 0 and lr > 0; got {self.repeat_span}, {self.epochs}, {self.lr}"
            )

    def check_window(self, seq_len: int) -> None:
        """A window must hold ``tails`` tails each after some mapped prefix, and room for the repeat."""
        if seq_len // self.tails <= self.tail or (self.repeat_span and seq_len <= 2 * self.repeat_span + 64):
            raise InvalidInput(
                f"training windows of {seq_len} tokens are too short for {self.tails} tail(s) of {self.tail} "
                f"and a repeat of {self.repeat_span}; use longer windows or a shorter tail or repeat"
            )

    def as_dict(self) -> dict:
        return {
            "from_layer": self.from_layer,
            "tail": self.tail,
            "tails": self.tails,
            "repeat_span": self.repeat_span,
            "epochs": self.epochs,
            "lr": self.lr,
            "seed": self.seed,
            "temperature": self.temperature,
            "ref_top_k": self.ref_top_k,
            "capture_precision": self.capture_precision,
            "train_precision": self.train_precision,
        }


@dataclass(frozen=True)
class TailRef:
    """The target's own next-token distributions over one tail, compact: per position the ``k`` most likely tokens'
    log-probabilities and the log of the mass of all others (about 0.5 KB a position at k = 64, against 300 KB for a
    151,936-token vocabulary), so the target's forward over a training window runs once and its result can be kept.

    The loss compares the two distributions on these k + 1 outcomes (each top token, and "any other"): the KL of a
    coarsening, never more than the full KL, equal to it where the rest's mass is negligible."""

    index: torch.Tensor  # [tail, k] token ids
    logp: torch.Tensor  # [tail, k] float32
    rest: torch.Tensor  # [tail] float32: log of the probability of every token outside ``index``

    @classmethod
    def of(cls, logits: torch.Tensor, k: int = REF_TOP_K) -> TailRef:
        """The reference of ``logits`` [tail, vocab] (the target's own, over the tail's positions)."""
        lp = logits.float().log_softmax(-1)
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        return cls(top.indices, top.values, _rest(lp, top.indices))

    def kl(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Mean KL(reference ‖ softmax(logits)) over the tail's positions, on the k + 1 outcomes, both at
        ``temperature`` (times its square, so gradients keep their scale)."""
        q = (logits.float() / temperature).log_softmax(-1)
        mine = torch.cat([q.gather(-1, self.index), _rest(q, self.index)[:, None]], -1)
        want = torch.cat([self.logp, self.rest[:, None]], -1)
        if temperature != 1.0:
            want = (want / temperature).log_softmax(-1)
        p = want.exp()
        return torch.where(p > 0, p * (want - mine), torch.zeros_like(p)).sum(-1).mean() * temperature**2


def _rest(lp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log of the probability outside ``index`` per row of log-probabilities ``lp`` (-inf when there is none)."""
    return lp.scatter(-1, index, float("-inf")).logsumexp(-1)


@dataclass(frozen=True)
class TailSample:
    """One training tail: its token ids, the target's full-prefill reference over them, and how to get the source cache
    up to its end with the fixed (untrained) mapped layers of its prefix: from memory, or read from the window's
    file when the tail is trained on (a distillation over hundreds of windows never holds their caches at once)."""

    ids: torch.Tensor
    ref: TailRef
    inputs: Callable[[], tuple[list[LayerKV], list[LayerKV]]]


def with_code_mlp(ms: MapSet, hidden: int, seed: int = 0) -> MapSet:
    """``ms`` (a shared-basis set) with a code MLP of ``hidden`` units added, its output weights zero: the same maps,
    now with a non-linearity that distillation can train."""
    if ms.basis is None:
        raise InvalidInput("a code MLP refines a shared basis' code: this set has no basis (fit one with --basis-rank)")
    if ms.basis.mlp is not None:
        raise InvalidInput(f"{ms.name} {ms.version} already has a code MLP of {ms.basis.mlp.hidden} units")
    if not isinstance(hidden, int) or hidden < 1:
        raise InvalidInput(f"the code MLP needs a positive number of hidden units, got {hidden!r}")
    g = torch.Generator().manual_seed(seed)
    r = ms.basis.rank
    mlp = CodeMLP(
        (torch.randn(r, hidden, generator=g) / r**0.5).to(ms.dtype),
        torch.zeros(hidden, dtype=ms.dtype),
        torch.zeros(hidden, r, dtype=ms.dtype),
    )
    b = ms.basis
    return MapSet(
        ms.source,
        ms.target,
        dict(ms.maps),
        ms.version,
        dict(ms.fit),
        dict(ms.calibration),
        basis=Basis(b.source_layers, b.encoder, b.bias, b.inputs, mlp),
    )


def with_repeat(ids: torch.Tensor, span: int, rng: random.Random) -> torch.Tensor:
    """``ids`` whose last ``span`` tokens are replaced by a copy of an earlier stretch (more than 64 tokens back)."""
    n = len(ids)
    start = rng.randrange(0, n - 2 * span - 64)
    out = ids.clone()
    out[n - span :] = ids[start : start + span]
    return out


class TrainableMaps:
    """float32 copies of the maps of target layers >= ``from_layer``, and the cache they give. A shared-basis set's
    encoder is trained too when every target layer is (``from_layer`` 0; otherwise it stays fixed, since the layers
    below read it as well), and so is its code MLP, where it has one."""

    def __init__(self, ms: MapSet, from_layer: int):
        self.ms, self.from_layer = ms, from_layer
        self.keys = sorted(k for k in ms.maps if k[0] >= from_layer)
        self.weight = {k: ms.maps[k].weight.float().clone().requires_grad_() for k in self.keys}
        self.bias = {k: ms.maps[k].bias.float().clone().requires_grad_() for k in self.keys}
        basis = ms.basis
        trained = basis is not None and from_layer == 0
        self.encoder = None if basis is None else basis.encoder.float().clone().requires_grad_(trained)
        self.encoder_bias = None if basis is None else basis.bias.float().clone().requires_grad_(trained)
        mlp = basis.mlp if basis is not None else None
        self.mlp = None if mlp is None else CodeMLP(*(t.float().clone().requires_grad_() for t in mlp.tensors()))
        self.shared: dict[str, torch.Tensor] = {}  # trained tensors every map reads: the encoder, the code MLP
        if trained:
            self.shared |= {"encoder": self.encoder, "encoder_bias": self.encoder_bias}
        if self.mlp is not None:
            self.shared |= dict(zip(("mlp_w_in", "mlp_b_in", "mlp_w_out"), self.mlp.tensors()))

    def params(self) -> list[torch.Tensor]:
        return [self.weight[k] for k in self.keys] + [self.bias[k] for k in self.keys] + list(self.shared.values())

    def state(self) -> dict:
        return {k: (self.weight[k].detach().clone(), self.bias[k].detach().clone()) for k in self.keys} | {
            name: (t.detach().clone(),) for name, t in self.shared.items()
        }

    def load_state(self, state: dict) -> None:
        with torch.no_grad():
            for k, saved in state.items():
                for mine, value in zip(
                    (self.weight[k], self.bias[k]) if k in self.weight else (self.shared[k],), saved
                ):
                    mine.copy_(value)

    def output(self, key: tuple[int, str], x: torch.Tensor) -> torch.Tensor:
        """Map ``key``'s output features for its inputs ``x`` [tokens, inputs] (research variants add to it)."""
        return x @ self.weight[key] + self.bias[key]

    def cache(self, source_kv: list[LayerKV], fixed: list[LayerKV], stop: int) -> list[LayerKV]:
        """The mapped cache of tokens [0, stop) (keys rotated as cached): layers below ``from_layer`` from ``fixed``."""
        g, rope = self.ms.target.geometry, self.ms.source.geometry.rope
        out = [(k[:, :, :stop], v[:, :, :stop]) for k, v in fixed[: self.from_layer]]
        per_source: dict[tuple[int, str], torch.Tensor] = {}  # each source layer's K or V un-rotated once per call

        def feature(layer: int, kind: str) -> torch.Tensor:
            if (layer, kind) not in per_source:
                x = source_kv[layer][0 if kind == "k" else 1][:, :, :stop]
                per_source[(layer, kind)] = to_features(x, rope if kind == "k" else None, range(stop))[0]
            return per_source[(layer, kind)]

        inputs: dict[tuple, torch.Tensor] = {}  # maps reading the same features share them
        for layer in range(self.from_layer, g.layers):
            kv = []
            for kind in ("k", "v"):
                m = self.ms.maps[(layer, kind)]
                sig = (m.source_layers, m.inputs, m.window)
                if sig not in inputs:
                    inputs[sig] = window_inputs(feature, *sig)
                    if self.encoder is not None:  # a shared-basis set's maps read the code of those features
                        inputs[sig] = inputs[sig] @ self.encoder + self.encoder_bias
                        if self.mlp is not None:
                            inputs[sig] = self.mlp(inputs[sig])
                y = self.output((layer, kind), inputs[sig])
                kv.append(from_features(y[None], g.kv_heads, g.rope if kind == "k" else None, range(stop)))
            out.append((kv[0], kv[1]))
        return out

    def mapset(self, version: str, fit_record: dict) -> MapSet:
        """The distilled set, its weights in the starting set's dtype; ``fit_record`` joins its fit provenance. A
        trained
        map's held-out R² is unknown (NaN): the closed form's no longer describes it (``kvferry eval`` measures it)."""
        maps, basis = dict(self.ms.maps), self.ms.basis
        if basis is not None:
            mlp = (
                None
                if self.mlp is None
                else CodeMLP(*(t.detach().to(self.ms.dtype).contiguous() for t in self.mlp.tensors()))
            )
            basis = Basis(
                basis.source_layers,
                self.encoder.detach().to(self.ms.dtype).contiguous(),
                self.encoder_bias.detach().to(self.ms.dtype).contiguous(),
                basis.inputs,
                mlp,
            )
        for k in self.keys:
            m = self.ms.maps[k]
            maps[k] = LayerMap(
                m.target_layer,
                m.kind,
                m.source_layers,
                self.weight[k].detach().to(self.ms.dtype).contiguous(),
                self.bias[k].detach().to(self.ms.dtype).contiguous(),
                m.lam,
                float("nan"),
                m.inputs,
                m.window,
            )
        fit = dict(self.ms.fit) | {"distilled": fit_record | {"base_version": self.ms.version}}
        return MapSet(self.ms.source, self.ms.target, maps, version, fit, dict(self.ms.calibration), basis=basis)


@torch.no_grad()
def capture_tails(
    ms: MapSet,
    source,
    target,
    windows: list[torch.Tensor],
    s: DistillSettings,
    rng: random.Random,
    cache_dir: str | Path | None = None,
    refs_dir: str | Path | None = None,
) -> list[TailSample]:
    """Tails of ``windows`` (every other one given a repeat): one source and one target prefill per window.

    ``cache_dir``: each window's source cache is kept there as it is made (``<source key>/<window>.safetensors``) and
    read back when a tail is trained on, so a stopped capture resumes and memory holds one window at a time.
    ``refs_dir`` (default ``cache_dir``): each window's compact references (:class:`TailRef`) are kept there
    (``<target key>/<window>.safetensors``, small enough to commit), so the target's forward over a window runs once."""
    out = []
    refs_dir = refs_dir if refs_dir is not None else cache_dir
    kv_folder = Path(cache_dir) / _model_key(ms.source, "source") if cache_dir else None
    ref_folder = Path(refs_dir) / _model_key(ms.target, f"refs {s.tail}:{s.tails}:{s.ref_top_k}") if refs_dir else None
    for i, ids in enumerate(windows):
        s.check_window(len(ids))
        if s.repeat_span and i % 2 == 1:
            ids = with_repeat(ids, s.repeat_span, rng)
        ends = _ends(len(ids), s)
        refs = _load(
            ref_folder,
            ids,
            lambda t: [TailRef(t[f"index{j}"].long(), t[f"logp{j}"], t[f"rest{j}"]) for j in range(len(ends))],
        )
        if refs is None:
            with autocast(target.model, s.capture_precision):
                logits = target.model(input_ids=ids[None]).logits[0]
            refs = [TailRef.of(logits[end - s.tail : end], s.ref_top_k) for end in ends]
            _save(
                ref_folder,
                ids,
                {
                    f"{name}{j}": getattr(r, name).to(torch.int32 if name == "index" else torch.float32)
                    for j, r in enumerate(refs)
                    for name in ("index", "logp", "rest")
                },
                {"precision": s.capture_precision},
            )
        skv = _load(kv_folder, ids, _read_kv)
        if skv is None:
            with autocast(source.model, s.capture_precision):
                skv = [(k.bfloat16(), v.bfloat16()) for k, v in capture_kv(source.model, ids[None])]
            _save(
                kv_folder,
                ids,
                {f"{kind}{l}": x for l, kv in enumerate(skv) for kind, x in zip("kv", kv)},
                {"precision": s.capture_precision},
            )
        load = _kept(kv_folder, ids, None if kv_folder is not None else skv)
        for end, ref in zip(ends, refs):
            out.append(TailSample(ids[end - s.tail : end].clone(), ref, _inputs(ms, s, load, end)))
    return out


def _read_kv(t: dict) -> list[LayerKV]:
    return [(t[f"k{l}"], t[f"v{l}"]) for l in range(sum(1 for n in t if n.startswith("k")))]


def _kept(folder: Path | None, ids: torch.Tensor, skv: list[LayerKV] | None) -> Callable[[], list[LayerKV]]:
    """A window's source cache on demand: ``skv`` itself, or (``skv`` None) read back from ``folder`` each time, so
    that memory holds one window's cache at a time."""

    def load() -> list[LayerKV]:
        got = skv if skv is not None else _load(folder, ids, _read_kv)
        if got is None:
            raise InvalidInput(
                f"a training window's source cache is gone from {folder}; run the capture again "
                "(it recaptures only what is missing)"
            )
        return got

    return load


def _inputs(ms: MapSet, s: DistillSettings, load: Callable[[], list[LayerKV]], end: int):
    """A tail's inputs on demand: the source cache up to ``end`` and the fixed mapped layers of its prefix."""

    def inputs() -> tuple[list[LayerKV], list[LayerKV]]:
        skv = [(k[:, :, :end].float(), v[:, :, :end].float()) for k, v in load()]
        with torch.no_grad():
            fixed = apply(ms, skv, 0)[: s.from_layer] if s.from_layer else []
        return skv, [(k[:, :, : end - s.tail], v[:, :, : end - s.tail]) for k, v in fixed]

    return inputs


def _ends(n: int, s: DistillSettings) -> list[int]:
    return [n // s.tails * (j + 1) for j in range(s.tails)]


def _model_key(identity, what: str) -> str:
    from ..geometry import digest

    return digest({"model": identity.as_dict(), "what": what})[:24]


def _pair_key(ms: MapSet) -> str:
    from ..geometry import digest

    return digest({"source": ms.source.as_dict(), "target": ms.target.as_dict()})[:24]


def _window_file(folder: Path, ids: torch.Tensor) -> Path:
    import hashlib

    return folder / (hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:32] + ".safetensors")


def _save(
    folder: Path | None, ids: torch.Tensor, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Keep a window's tensors (with its ids and ``metadata``) in ``folder``, written whole by one rename; nothing
    without a folder."""
    import os

    from safetensors.torch import save_file

    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = _window_file(folder, ids)
    save_file(
        {"ids": ids.to(torch.int64).contiguous()} | {k: v.contiguous() for k, v in tensors.items()},
        str(path.with_suffix(".tmp")),
        metadata=metadata,
    )
    os.replace(path.with_suffix(".tmp"), path)


def _load(folder: Path | None, ids: torch.Tensor, read: Callable[[dict], object]):
    """``read`` of the window's kept tensors, or None when the folder has none for exactly these ids."""
    from safetensors.torch import load_file

    if folder is None:
        return None
    path = _window_file(folder, ids)
    if not path.is_file():
        return None
    t = load_file(str(path))
    if not torch.equal(t["ids"], ids.to(torch.int64)):
        return None
    return read({k: v for k, v in t.items() if k != "ids"})


def tail_kl(target_model, maps: TrainableMaps, sample: TailSample, temperature: float = 1.0) -> torch.Tensor:
    """Mean KL(full ‖ mapped) over the tail's next-token distributions on its reference's outcomes, at
    ``temperature`` (times its square, so gradients keep their scale)."""
    skv, fixed = sample.inputs()
    stop = skv[0][0].shape[2] - len(sample.ids)
    cache = to_dynamic_cache(maps.cache(skv, fixed, stop), target_model.config)
    logits = target_model(input_ids=sample.ids[None], past_key_values=cache).logits[0]
    return sample.ref.kl(logits, temperature)


def distill(
    ms: MapSet,
    source,
    target,
    train: list[TailSample],
    held: list[TailSample],
    s: DistillSettings,
    progress: Callable[[str], None] | None = None,
    maps: TrainableMaps | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: float = 600.0,
    keep: str = "best",
) -> tuple[TrainableMaps, list[dict]]:
    """Adam on the maps' weights from the set's own (or on ``maps.params()``, a TrainableMaps of ``ms`` given by the
    caller); returns the maps at the epoch with the lowest held-out KL (``keep`` "best") or at the last epoch ("last":
    to measure what the training reached, even where it is worse than where it started), and the per-epoch log
    (train and held-out KL).

    ``checkpoint``: the whole training state (weights, optimiser, schedule, position in the epoch, the best epoch
    so far) is written there at least every ``checkpoint_every`` seconds and after each epoch; a run started with
    the same map, settings and tails resumes from it and ends where an uninterrupted run would."""
    if not train or not held:
        raise InvalidInput("distillation needs training and held-out tails; give it more text")
    if keep not in ("best", "last"):
        raise InvalidInput(f"keep must be 'best' or 'last', got {keep!r}")
    for p in target.model.parameters():
        p.requires_grad_(False)
    maps = maps or TrainableMaps(ms, s.from_layer)
    if not maps.keys:
        raise InvalidInput(f"the set has no maps of target layer {s.from_layer} or above to train")
    opt = torch.optim.Adam(maps.params(), lr=s.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=s.lr, total_steps=max(1, s.epochs * len(train)), pct_start=0.1
    )
    say = progress or (lambda _: None)
    run_key = _run_key(ms, s, train, held)

    def held_kl() -> float:
        with torch.no_grad(), autocast(target.model, s.train_precision):
            return sum(float(tail_kl(target.model, maps, x)) for x in held) / len(held)

    gen = torch.Generator().manual_seed(s.seed)
    state = _load_checkpoint(checkpoint, run_key) if checkpoint else None
    if state is None:
        log = [{"epoch": 0, "held_kl": held_kl()}]
        best, epoch, done, total, order = (log[0]["held_kl"], maps.state(), 0), 1, 0, 0.0, None
        say(f"epoch 0 (starting map): held-out tail KL {log[0]['held_kl']:.4f}")
    else:
        maps.load_state(state["maps"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        log, best, epoch, done, total, order = (state[k] for k in ("log", "best", "epoch", "done", "total", "order"))
        say(f"resumed from {checkpoint}: epoch {epoch}, {done} of {len(train)} tails done")
    last_save = time.monotonic()

    def save() -> None:
        _save_checkpoint(
            checkpoint,
            {
                "key": run_key,
                "maps": maps.state(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "gen": gen.get_state(),
                "log": log,
                "best": best,
                "epoch": epoch,
                "done": done,
                "total": total,
                "order": order,
            },
        )

    while epoch <= s.epochs:
        if order is None:
            order = torch.randperm(len(train), generator=gen).tolist()
        for j in order[done:]:
            with autocast(target.model, s.train_precision):
                loss = tail_kl(target.model, maps, train[j], s.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
            done += 1
            if done % 50 == 0:
                say(f"  epoch {epoch}: {done} of {len(train)} tails, train tail KL so far {total / done:.4f}")
            if checkpoint and time.monotonic() - last_save > checkpoint_every:
                save()
                last_save = time.monotonic()
        kl = held_kl()
        log.append({"epoch": epoch, "train_kl": total / len(train), "held_kl": kl})
        say(f"epoch {epoch}: train tail KL {total / len(train):.4f}, held-out {kl:.4f}")
        if kl < best[0]:
            best = (kl, maps.state(), epoch)
        epoch, done, total, order = epoch + 1, 0, 0.0, None
        if checkpoint:
            save()
            last_save = time.monotonic()
    if keep == "best":
        maps.load_state(best[1])
    log.append({"kept_epoch": best[2] if keep == "best" else epoch - 1})
    return maps, log


def _run_key(ms: MapSet, s: DistillSettings, train: list[TailSample], held: list[TailSample]) -> str:
    """What a checkpoint belongs to: the starting map, the settings and the tails' token ids."""
    import hashlib

    h = hashlib.sha256(f"{ms.name} {ms.version} {_pair_key(ms)} {s.as_dict()}".encode())
    for x in train + held:
        h.update(x.ids.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def _save_checkpoint(path: str | Path, state: dict) -> None:
    """The training state as safetensors (every tensor) with the rest as JSON in its metadata: nothing that runs
    code."""
    import json
    import os

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def put(obj):  # tensors out by name, the structure kept as JSON
        if isinstance(obj, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = obj.detach().contiguous().clone()
            return {"__tensor__": name}
        if isinstance(obj, dict):
            return {"__dict__": [[put(k), put(v)] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return {"__list__": [put(v) for v in obj], "tuple": isinstance(obj, tuple)}
        return obj

    meta = json.dumps(put(state))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    save_file(tensors, str(tmp), metadata={"state": meta})
    os.replace(tmp, path)


def _load_checkpoint(path: str | Path, key: str) -> dict | None:
    import json

    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable itself
        tensors = {name: f.get_tensor(name) for name in names}
        meta = json.loads(f.metadata()["state"])

    def get(obj):
        if isinstance(obj, dict) and "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if isinstance(obj, dict) and "__dict__" in obj:
            return {get(k): get(v) for k, v in obj["__dict__"]}
        if isinstance(obj, dict) and "__list__" in obj:
            items = [get(v) for v in obj["__list__"]]
            return tuple(items) if obj["tuple"] else items
        return obj

    state = get(meta)
    return state if state.get("key") == key else None
