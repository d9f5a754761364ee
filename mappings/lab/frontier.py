"""The speed/quality frontier: each measure the gate reads against the share of the target's prefill spent.

An operator chooses how much of the target's prefill to pay for how much of its quality. The operating points, all on
the same prompts and scored against the target's own full prefill:

  truncate r         the target computes only the prompt's last r tokens (share r / n)
  <map> refresh r    the map's cache for all but the last r tokens, which the target recomputes (share r / n)
  <map> hybrid L     the target computes its first L layers over the whole prompt itself, the map gives the other
                     layers, and the target recomputes the last r₀ tokens (share L / layers + (1 - L / layers) r₀ / n)
  full prefill       share 1

The source's own prefill is not counted: in a cascade it has run already. Measures: copy kept (the unguessable copy
probe's accuracy over full prefill's, per domain and gap), next-token top-10 overlap (per domain) and the downstream
task (:mod:`next_line`: a file's next line after 2,000+ tokens of it, its edit similarity minus full prefill's, the
gate's downstream measure), each with its paired 95% interval (:mod:`intervals`). The target's own arms (copy, the
next line under full prefill and truncation) come from the evaluation's references (:mod:`memo`) where given.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import torch

from ..apply import apply
from ..artifact import MapSet
from ..cache import LayerKV, kv_slice, to_dynamic_cache
from ..errors import InvalidInput
from ..intervals import difference_interval, mean_interval, ratio_interval
from .capture import LoadedModel, capture_first_layers, capture_kv, token_windows
from .completion import write_line
from .copy_probe import CopySettings, continuation_accuracy, examples_for
from .memo import Memo, remembered
from .next_line import NextLineSettings, edit_similarity, make_tasks

NEXT_LINE = "next line: edit similarity minus full prefill's"


@dataclass(frozen=True)
class FrontierSettings:
    """Which operating points the frontier measures, on how many prompts."""

    refreshes: tuple[int, ...] = (16, 64, 256, 1024)
    """r: the tokens the target recomputes, for truncation and for each map's refresh."""
    hybrid_layers: tuple[int, ...] = (4, 8)
    """L: target layers the target computes itself in the hybrid points (with refresh ``refreshes[0]``)."""
    copy: CopySettings = field(default_factory=lambda: CopySettings(prompts=12))
    """The copy probe's prompts (its ``refresh`` is not read: ``refreshes`` are)."""
    next_token_prompts: int = 20
    """Next-token prompts per domain, of ``min_len``-``max_len`` tokens (0: no top-10 measure)."""
    min_len: int = 128
    max_len: int = 384
    next_line: NextLineSettings | None = None
    """The downstream task's files and lengths (its ``refresh`` is not read: ``refreshes`` are); None: not measured."""
    seed: int = 0

    def __post_init__(self) -> None:
        if (
            not self.refreshes
            or any(r < 1 for r in self.refreshes)
            or list(self.refreshes) != sorted(set(self.refreshes))
        ):
            raise InvalidInput(f"refreshes must be increasing positive token counts, got {self.refreshes}")
        if any(L < 1 for L in self.hybrid_layers):
            raise InvalidInput(f"hybrid layers must be positive, got {self.hybrid_layers}")
        if self.next_token_prompts < 0 or not 2 <= self.min_len <= self.max_len or self.refreshes[0] >= self.min_len:
            raise InvalidInput("need next_token_prompts >= 0, 2 <= min_len <= max_len and refreshes[0] < min_len")

    def as_dict(self) -> dict:
        return asdict(self) | {"copy": self.copy.as_dict(), "next_line": self.next_line and self.next_line.as_dict()}


def operating_points(versions: list[str], s: FrontierSettings, layers: int) -> list[tuple[str, str | None, int, int]]:
    """(arm, map version or None, r, L) of every point, in plotting order; hybrid L at or above ``layers`` is left
    out."""
    points = [("truncate", None, r, 0) for r in s.refreshes]
    for v in versions:
        points += [("refresh", v, r, 0) for r in s.refreshes]
        points += [("hybrid", v, s.refreshes[0], L) for L in s.hybrid_layers if layers > L]
    return points


def point_name(arm: str, version: str | None, r: int, L: int) -> str:
    return {"truncate": f"truncate r={r}", "refresh": f"{version} refresh r={r}", "hybrid": f"{version} hybrid L={L}"}[
        arm
    ]


def share(arm: str, r: int, L: int, n: int, layers: int) -> float:
    """The share of the target's prefill of an ``n``-token prompt that a point spends (r capped at n)."""
    tail = min(r, n) / n
    return L / layers + (1 - L / layers) * tail if arm == "hybrid" else tail


def _caches(
    maps: dict[str, MapSet], source: LoadedModel, target: LoadedModel, ids: list[int], s: FrontierSettings, layers: int
) -> dict[str, list[LayerKV]]:
    """Each map's cache of ``ids``, and each hybrid point's (the target's first L layers, the map's others)."""
    skv = capture_kv(source.model, torch.tensor([ids]))
    out = {v: apply(ms, skv, 0) for v, ms in maps.items()}
    hybrid = [L for L in s.hybrid_layers if layers > L]
    if hybrid:
        own = capture_first_layers(target.model, torch.tensor([ids]), max(hybrid))
        for v in maps:
            for L in hybrid:
                out[f"{v}@{L}"] = own[:L] + out[v][L:]
    return out


def _prefix(caches: dict[str, list[LayerKV]], arm: str, v: str | None, r: int, L: int, n: int):
    """The cache a point's target continues from (None: truncation, or nothing left to reuse) and the first token it
    computes."""
    stop = max(n - r, 0)
    if arm == "truncate" or stop == 0:
        return None, stop
    return kv_slice(caches[v] if arm == "refresh" else caches[f"{v}@{L}"], 0, stop), stop


def _per_point(points: list[tuple], full: bool = False) -> dict:
    """Empty per-prompt lists: each point's measure and share (and, with ``full``, full prefill's measure)."""
    out = {"points": {point_name(*p): [] for p in points}, "share": {point_name(*p): [] for p in points}}
    return {"full": [], **out} if full else out


@torch.no_grad()
def copy_points(
    maps: dict[str, MapSet],
    source: LoadedModel,
    target: LoadedModel,
    texts: list[str],
    s: FrontierSettings,
    memo: Memo | None = None,
    progress: bool = False,
) -> dict:
    """Per gap: full prefill's per-prompt accuracy, each point's, and each point's per-prompt share."""
    layers = target.identity.geometry.layers
    points = operating_points(list(maps), s, layers)
    who = (target.identity.weights, target.identity.geometry.fingerprint)
    examples = examples_for(target.tokenizer, texts, s.copy)
    if progress:
        from tqdm import tqdm

        examples = tqdm(examples, desc="frontier: copy", unit="prompt")
    out: dict[str, dict] = {}
    for ex in examples:
        n = len(ex.prompt)
        row = out.setdefault(
            str(ex.gap),
            _per_point(points, full=True),
        )
        row["full"].append(
            remembered(
                memo,
                ("copy-full", *who, ex.prompt, ex.answer),
                lambda: continuation_accuracy(target.model, None, ex.prompt, ex.answer),
            )
        )
        caches = _caches(maps, source, target, ex.prompt[:-1], s, layers)
        for arm, v, r, L in points:
            name = point_name(arm, v, r, L)
            if arm == "truncate":
                acc = remembered(
                    memo,
                    ("copy-truncate", *who, r, ex.prompt, ex.answer),
                    lambda: continuation_accuracy(target.model, None, ex.prompt[max(n - r, 0) :], ex.answer),
                )
            else:
                kv, stop = _prefix(caches, arm, v, r, L, n)
                acc = continuation_accuracy(target.model, kv, ex.prompt[stop:], ex.answer)
            row["points"][name].append(acc)
            row["share"][name].append(share(arm, r, L, n, layers))
    return out


@torch.no_grad()
def top10_points(
    maps: dict[str, MapSet], source: LoadedModel, target: LoadedModel, texts: list[str], s: FrontierSettings
) -> dict:
    """Each point's per-prompt top-10 overlap with full prefill at the prompt's last position, and its share."""
    layers = target.identity.geometry.layers
    points = operating_points(list(maps), s, layers)
    windows = token_windows(target.tokenizer, texts, s.max_len)
    if not windows:
        raise InvalidInput(f"held-out text is shorter than one {s.max_len}-token prompt")
    rng = random.Random(s.seed + 1)
    out = _per_point(points)
    for i in range(s.next_token_prompts):
        ids = windows[i % len(windows)][: rng.randint(s.min_len, s.max_len)].tolist()
        n = len(ids)
        gold = target.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        want = set(gold.topk(10).indices.tolist())
        caches = _caches(maps, source, target, ids[:-1], s, layers)
        for arm, v, r, L in points:
            kv, stop = _prefix(caches, arm, v, r, L, n)
            cache = to_dynamic_cache(kv, target.model.config) if kv is not None else None
            logits = target.model(input_ids=torch.tensor([ids[stop:]]), past_key_values=cache).logits[0, -1].float()
            out["points"][point_name(arm, v, r, L)].append(len(want & set(logits.topk(10).indices.tolist())) / 10)
            out["share"][point_name(arm, v, r, L)].append(share(arm, r, L, n, layers))
    return out


@torch.no_grad()
def next_line_points(
    maps: dict[str, MapSet],
    source: LoadedModel,
    target: LoadedModel,
    files: list[str],
    s: FrontierSettings,
    memo: Memo | None = None,
    progress: bool = False,
) -> dict:
    """Full prefill's per-task edit similarity on the next-line task, each point's, and each point's per-task share.
    The target's own lines are remembered under the keys ``kvferry eval``'s next-line task uses, so one set of
    references serves both."""
    if s.next_line is None:
        raise InvalidInput("the frontier's next-line points need FrontierSettings.next_line")
    layers = target.identity.geometry.layers
    points = operating_points(list(maps), s, layers)
    tok, most = target.tokenizer, s.next_line.max_new_tokens
    who = (target.identity.weights, target.identity.geometry.fingerprint, most)
    tasks = make_tasks(tok, files, s.next_line)
    if progress:
        from tqdm import tqdm

        tasks = tqdm(tasks, desc="frontier: next line", unit="task")
    out = _per_point(points, full=True)
    for task in tasks:
        prompt, n = task.prompt, len(task.prompt)
        full = remembered(
            memo, ("next-line-full", *who, prompt), lambda: write_line(target.model, tok, prompt, None, most) or ""
        )
        out["full"].append(edit_similarity(full, task.answer))
        caches = _caches(maps, source, target, prompt, s, layers)
        for arm, v, r, L in points:
            name = point_name(arm, v, r, L)
            if arm == "truncate":
                ids = prompt[max(n - r, 0) :]
                line = remembered(
                    memo,
                    ("next-line-truncate", *who, ids),
                    lambda: write_line(target.model, tok, ids, None, most) or "",
                )
            else:
                kv, _ = _prefix(caches, arm, v, r, L, n)
                line = write_line(target.model, tok, prompt, kv, most)
            out["points"][name].append(edit_similarity(line, task.answer))
            out["share"][name].append(share(arm, r, L, n, layers))
    return out


def summarize(raw: dict, s: FrontierSettings, versions: list[str], layers: int) -> dict:
    """The frontier's JSON: per measure, each point's share, value and interval."""
    measures: dict[str, dict] = {}
    for domain, got in raw.items():
        if domain == "next_line":
            continue
        for gap, row in got.get("copy", {}).items():
            if sum(row["full"]) == 0:
                continue
            measures[f"copy kept, {domain}, gap {gap}"] = {
                name: _cell(sum(row["share"][name]) / len(row["share"][name]), ratio_interval(acc, row["full"]))
                for name, acc in row["points"].items()
            }
        if "top10" in got:
            t = got["top10"]
            measures[f"top-10, {domain}"] = {
                name: _cell(sum(t["share"][name]) / len(t["share"][name]), mean_interval(v))
                for name, v in t["points"].items()
                if v
            }
    if "next_line" in raw:
        t = raw["next_line"]
        measures[NEXT_LINE] = {
            name: _cell(sum(t["share"][name]) / len(t["share"][name]), difference_interval(v, t["full"]))
            for name, v in t["points"].items()
            if v
        }
    points = [
        {"name": point_name(*p), "arm": p[0], "map": p[1], "r": p[2], "layers": p[3]}
        for p in operating_points(versions, s, layers)
    ]
    return {"settings": s.as_dict(), "points": points, "measures": measures}


def _cell(share_: float, iv) -> dict:
    return {"share": round(share_, 6), "value": round(iv.value, 6), "interval": iv.as_list()}


def format_frontier(front: dict) -> str:
    """A plain-text table: one row per point, one column per measure (value [interval])."""
    names = list(front["measures"])
    lines = ["| point | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for p in front["points"]:
        cells = []
        for m in names:
            c = front["measures"][m].get(p["name"])
            cells.append(
                ""
                if c is None
                else f"{c['value']:.3f} [{c['interval'][0]:.3f}, {c['interval'][1]:.3f}] @ {c['share']:.3f}"
            )
        lines.append(f"| {p['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(front: dict, path, title: str = "") -> None:
    """One panel per measure: each point's value (with its interval as an error bar) against its share of the
    target's prefill, a line per series (truncation; each map's refresh; each map's hybrid), full prefill at (1, 1)
    ((1, 0) on the next line's difference) and the gate's default bar dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..gates import Gates

    gates = Gates()
    bars = {"copy kept": gates.min_copy_retention, "top-10": gates.min_top10, NEXT_LINE: -gates.max_completion_drop}
    names = list(front["measures"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    series: dict[str, list[dict]] = {}
    for p in front["points"]:
        series.setdefault("truncate" if p["arm"] == "truncate" else f"{p['map']} {p['arm']}", []).append(p)
    for ax, m in zip(axes.flat, names):
        cells = front["measures"][m]
        for label, pts in series.items():
            got = [(cells[p["name"]], p) for p in pts if p["name"] in cells]
            if not got:
                continue
            xs = [c["share"] for c, _ in got]
            ys = [c["value"] for c, _ in got]
            err = [
                [max(c["value"] - c["interval"][0], 0) for c, _ in got],
                [max(c["interval"][1] - c["value"], 0) for c, _ in got],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        ax.plot(
            [1],
            [0 if m == NEXT_LINE else 1],
            marker="*",
            markersize=10,
            color="black",
            linestyle="none",
            label="full prefill",
        )
        bar = next((v for prefix, v in bars.items() if m.startswith(prefix)), None)
        if bar is not None:
            ax.axhline(bar, color="grey", linestyle="--", linewidth=1, label="the gate's bar")
        ax.set_xscale("log")
        ax.set_xlabel("share of the target's prefill spent")
        ax.set_title(m, fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
