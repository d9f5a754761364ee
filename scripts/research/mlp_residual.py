"""Where does the linear map stop? A small MLP on the residual of the closed-form map, on the same features.

Reads the per-window features ``kvferry fit --features`` kept (both models' position-free K and V of every layer),
splits the calibration windows as the fit does (every 5th held out), fits the closed-form ridge map from every
source layer on the training windows alone (one Cholesky factor for all target columns; the relative lambda chosen
by held-out R² from a grid), then trains ``y = ridge(x) + mlp(x)`` (the ridge part frozen, the MLP starting at
zero) with Adam on the mean squared error, each output column scaled by its spread. Prints held-out R² per target
layer and K/V for the ridge map alone and with the MLP, side by side, on windows neither saw. Example:

    python scripts/research/mlp_residual.py --features runs/features --tokenizer models/pretrained/qwen2.5-coder-0.5b \
        --corpus data/calib.jsonl data/prose_calib.jsonl --hidden 2048 --epochs 3 --out runs/results/mlp_residual.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from kvferry.mappings.capture import read_corpus, token_windows

LAMBDAS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def _files(folder: Path, windows: list[torch.Tensor]) -> list[Path]:
    by_stem = {p.stem: p for p in folder.rglob("*.safetensors")}
    out = []
    for w in windows:
        stem = hashlib.sha256(w.to(torch.int64).numpy().tobytes()).hexdigest()[:32]
        if stem not in by_stem:
            raise SystemExit(f"no features for a window of the corpus in {folder}: run kvferry fit --features with it")
        out.append(by_stem[stem])
    return out


def _r2_by_block(sse: torch.Tensor, sst: torch.Tensor, width: int) -> list[float]:
    return [float(1 - sse[i:i + width].sum() / sst[i:i + width].sum()) for i in range(0, len(sse), width)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True, help="the source model's folder (windows are cut with it)")
    ap.add_argument("--corpus", nargs="+", required=True)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--width", type=int, default=256, help="the target's kv width (kv_heads * head_dim)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("runs/results/mlp_residual.json"))
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    windows = token_windows(AutoTokenizer.from_pretrained(a.tokenizer), read_corpus(a.corpus), a.seq_len)
    files = _files(a.features, windows)
    held = [f for i, f in enumerate(files) if i % 5 == 0]
    train = [f for i, f in enumerate(files) if i % 5 != 0]
    t0 = time.perf_counter()
    n = sx = sy = sxx = sxy = None
    for f in train:
        t = load_file(str(f))
        x, y = t["x"].double(), t["y"].double()
        if n is None:
            n, sx, sy = 0, torch.zeros(x.shape[1], dtype=torch.float64), torch.zeros(y.shape[1], dtype=torch.float64)
            sxx, sxy = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64), torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)
        n, sx, sy = n + x.shape[0], sx + x.sum(0), sy + y.sum(0)
        sxx += x.T @ x
        sxy += x.T @ y
    mx, my = sx / n, sy / n
    cxx, cxy = sxx - n * torch.outer(mx, mx), sxy - n * torch.outer(mx, my)
    scale = float(cxx.diagonal().mean())
    print(f"train sums over {len(train)} windows in {time.perf_counter() - t0:.0f} s", flush=True)
    heldout = [load_file(str(f)) for f in held]
    hy = torch.cat([t["y"] for t in heldout]).double()
    sst = ((hy - hy.mean(0)) ** 2).sum(0)
    best = None
    for lam in LAMBDAS:
        w = torch.cholesky_solve(cxy, torch.linalg.cholesky(cxx + lam * scale * torch.eye(len(mx), dtype=torch.float64)))
        b = my - mx @ w
        sse = sum((((t["x"].double() @ w + b) - t["y"].double()) ** 2).sum(0) for t in heldout)
        r2 = float(1 - sse.sum() / sst.sum())
        print(f"lambda {lam:g}: held-out R² {r2:.4f}", flush=True)
        if best is None or r2 > best[0]:
            best = (r2, lam, w.float(), b.float(), sse)
    _, lam, w, b, sse_ridge = best
    ridge = lambda x: x @ w + b  # noqa: E731
    first = load_file(str(train[0]))
    xm, xs = first["x"].mean(0), first["x"].std(0).clamp(min=1e-3)
    ys = first["y"].std(0).clamp(min=1e-3)
    dx, dy = first["x"].shape[1], first["y"].shape[1]
    net = torch.nn.Sequential(torch.nn.Linear(dx, a.hidden), torch.nn.GELU(), torch.nn.Linear(a.hidden, dy))
    torch.nn.init.zeros_(net[2].weight)
    torch.nn.init.zeros_(net[2].bias)
    opt = torch.optim.Adam(net.parameters(), lr=a.lr)
    per_window = -(-a.seq_len // a.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.epochs * len(train) * per_window,
                                                pct_start=0.05)
    log = []
    for epoch in range(a.epochs):
        total = 0.0
        for j in torch.randperm(len(train)).tolist():
            t = load_file(str(train[j]))
            x, y = t["x"], t["y"]
            with torch.no_grad():
                resid = (y - ridge(x)) / ys
            for s in range(0, x.shape[0], a.batch):
                loss = ((net((x[s:s + a.batch] - xm) / xs) - resid[s:s + a.batch]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += float(loss)
        with torch.no_grad():
            sse_mlp = sum((((ridge(t["x"]) + net((t["x"] - xm) / xs) * ys).double() - t["y"].double()) ** 2).sum(0)
                          for t in heldout)
        log.append({"epoch": epoch + 1, "train_mse": total / (len(train) * per_window),
                    "heldout_r2": float(1 - sse_mlp.sum() / sst.sum()), "seconds": time.perf_counter() - t0})
        print(log[-1], flush=True)
    layers = dy // (2 * a.width)
    ridge_r2, mlp_r2 = _r2_by_block(sse_ridge, sst, a.width), _r2_by_block(sse_mlp, sst, a.width)
    names = [f"{l}{kind}" for kind in "kv" for l in range(layers)]
    result = {"lambda": lam, "hidden": a.hidden, "epochs": a.epochs, "train_windows": len(train), "heldout_windows": len(held),
              "log": log, "heldout_r2": {k: [r, m] for k, r, m in zip(names, ridge_r2, mlp_r2)},
              "mean": {kind: {"ridge": sum(ridge_r2[i * layers:(i + 1) * layers]) / layers,
                              "ridge+mlp": sum(mlp_r2[i * layers:(i + 1) * layers]) / layers} for i, kind in enumerate("kv")}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["mean"], indent=1))


if __name__ == "__main__":
    main()
