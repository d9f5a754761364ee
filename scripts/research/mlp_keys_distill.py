"""Issue 13, the 10-layer source: a non-linear key map trained by distillation (the one objective that moved copying).

The shipped 10-layer map (0.3.0: windowed keys of target layers 10-24 from source layers 4-9 at t, t-1, t-2,
distilled) is frozen; the keys of target layers 15-19, where the oracle swaps located the lost copying, get a residual
MLP over the same window inputs (Linear(inputs -> hidden) -> GELU -> Linear(-> 192), the last layer zero so training
starts at the map), trained by `kvferry.mappings.distill` through the frozen target (KL of the tail after the mapped
prefix; every other window ends with a repeat). The linear maps stay as they are, so a gain is the MLP's. Then the copy
probe, mapped + refresh 16, on held-out prompts: the frozen map and the map + MLP side by side.

    .venv/bin/python scripts/research/mlp_keys_distill.py --windows 64 --epochs 3 --json runs/results/mlp_keys_distill.json
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from kvferry import paths, pretrained
from kvferry.bench.harness import write_json
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.capture import capture_kv, load_model, read_corpus, token_stream, token_windows
from kvferry.mappings.copy_probe import CopySettings, continuation_accuracy, make_examples
from kvferry.mappings.distill import DistillSettings, TrainableMaps, capture_tails, distill


class MLPKeys(TrainableMaps):
    """The set's maps frozen; a zero-started residual MLP on the keys of ``layers``."""

    def __init__(self, ms, from_layer: int, layers: range, hidden: int):
        super().__init__(ms, from_layer)
        for k in self.keys:
            self.weight[k].requires_grad_(False)
            self.bias[k].requires_grad_(False)
        self.mlp = {}
        for layer in layers:
            w = self.weight[(layer, "k")]
            net = torch.nn.Sequential(torch.nn.Linear(w.shape[0], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, w.shape[1]))
            torch.nn.init.zeros_(net[2].weight)
            torch.nn.init.zeros_(net[2].bias)
            self.mlp[(layer, "k")] = net

    def params(self):
        return [p for net in self.mlp.values() for p in net.parameters()]

    def state(self):
        return {k: {n: t.detach().clone() for n, t in net.state_dict().items()} for k, net in self.mlp.items()}

    def load_state(self, state):
        for k, sd in state.items():
            self.mlp[k].load_state_dict(sd)

    def output(self, key, x):
        y = super().output(key, x)
        return y + self.mlp[key](x) if key in self.mlp else y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", default=str(paths.maps_dir() / "smollm2-135m-l10__smollm2-135m" / "0.3.0"))
    ap.add_argument("--windows", type=int, default=64, help="train-split windows of 1,024 tokens (2 tails each)")
    ap.add_argument("--skip-windows", type=int, default=960, help="train windows skipped (the shipped map's runs used the first ~900)")
    ap.add_argument("--layers", default="15-19")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gaps", default="500,1000,3000")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    ms = load(a.map)
    source = load_model(pretrained.cut("smollm2-135m", ms.source.geometry.layers))
    target = load_model(pretrained.fetch("smollm2-135m"))
    first, last = map(int, a.layers.split("-"))
    s = DistillSettings(from_layer=ms.source.geometry.layers, epochs=a.epochs, lr=a.lr, tails=2, seed=13)
    train_text = read_corpus([Path("runs/data/train.jsonl")])
    train_w = token_windows(target.tokenizer, train_text, 1024, (a.skip_windows + a.windows) * 1024)[a.skip_windows:]
    held_w = token_windows(target.tokenizer, read_corpus([paths.data_file("calib.jsonl")]), 1024)[:12]
    rng = random.Random(s.seed)
    train, held = capture_tails(ms, source, target, train_w, s, rng), capture_tails(ms, source, target, held_w, s, rng)
    print(f"{len(train)} training and {len(held)} held-out tails ({time.perf_counter() - t0:.0f} s)", flush=True)
    maps, log = distill(ms, source, target, train, held, s, progress=print,
                        maps=MLPKeys(ms, s.from_layer, range(first, last + 1), a.hidden))
    trained = time.perf_counter() - t0
    copy = CopySettings(gaps=tuple(int(g) for g in a.gaps.split(",")), prompts=a.prompts, seed=11)  # not the evidence's
    examples = make_examples(token_stream(target.tokenizer, read_corpus([paths.data_file("heldout.jsonl")])), copy)
    rows: dict[int, dict[str, list[float]]] = {}
    r = copy.refresh
    with torch.no_grad():
        for ex in examples:
            n = len(ex.prompt)
            skv = capture_kv(source.model, torch.tensor([ex.prompt[: n - r]]))
            base = apply(ms, skv, 0)
            mlp = maps.cache(skv, base, n - r)
            row = rows.setdefault(ex.gap, {"full": [], "truncate": [], "map": [], "map+mlp": []})
            row["full"].append(continuation_accuracy(target.model, None, ex.prompt, ex.answer))
            row["truncate"].append(continuation_accuracy(target.model, None, ex.prompt[n - r:], ex.answer))
            row["map"].append(continuation_accuracy(target.model, base, ex.prompt[n - r:], ex.answer))
            row["map+mlp"].append(continuation_accuracy(target.model, mlp, ex.prompt[n - r:], ex.answer))
    means = {g: {k: sum(v) / len(v) for k, v in row.items()} for g, row in rows.items()}
    print("| arm | " + " | ".join(f"gap {g}" for g in means) + " | kept (min over gaps) |")
    print("|---|" + "---|" * (len(means) + 1))
    for arm in ("full", "truncate", "map", "map+mlp"):
        kept = min(m[arm] / m["full"] for m in means.values())
        print(f"| {arm} | " + " | ".join(f"{m[arm]:.3f}" for m in means.values()) + f" | {kept:.2f} |")
    write_json(a.json, {"settings": vars(a) | {"json": str(a.json)}, "distill_log": log, "copy": means,
                        "seconds": {"capture_and_training": trained, "total": time.perf_counter() - t0}})


if __name__ == "__main__":
    main()
