"""Issue 13 lever: a small MLP that learns what a closed-form ridge map leaves (the non-linear residual).

y ≈ x @ W + b + mlp(x), with W, b the ridge solution (kept fixed) and mlp = Linear → GELU → Linear whose last layer
starts at zero, so training starts exactly at the ridge map and can only be kept where the held-out error drops.
Inputs are standardised per column, the residual per output column; the loss is the mean squared standardised
residual. Early stopping: the epoch with the best held-out mean R² over the output blocks is kept.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class ResidualMLP(nn.Module):
    def __init__(self, x_mean, x_std, r_std, hidden: int):
        super().__init__()
        self.register_buffer("x_mean", x_mean)
        self.register_buffer("x_std", x_std)
        self.register_buffer("r_std", r_std)
        self.up = nn.Linear(x_mean.numel(), hidden)
        self.down = nn.Linear(hidden, r_std.numel())
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The residual in the target's units."""
        return self.down(nn.functional.gelu(self.up((x - self.x_mean) / self.x_std))) * self.r_std


def block_r2(pred: torch.Tensor, y: torch.Tensor, width: int) -> list[float]:
    """R² of each ``width``-column block of ``y``."""
    out = []
    for b in range(y.shape[1] // width):
        sl = slice(b * width, (b + 1) * width)
        out.append(1 - float(((pred[:, sl] - y[:, sl]) ** 2).sum() / ((y[:, sl] - y[:, sl].mean(0)) ** 2).sum()))
    return out


@torch.enable_grad()
def train(x: torch.Tensor, y: torch.Tensor, held: int, w: torch.Tensor, b: torch.Tensor, width: int, *,
          hidden: int = 1024, epochs: int = 8, batch: int = 512, lr: float = 1e-3, seed: int = 0) -> tuple[ResidualMLP, list[float]]:
    """Fit the residual of ``x @ w + b`` against ``y``; the last ``held`` rows are the held-out split."""
    torch.manual_seed(seed)
    xtr, ytr, xho, yho = x[:-held], y[:-held], x[-held:], y[-held:]
    with torch.no_grad():
        rtr = ytr - (xtr @ w + b)
        base_ho = xho @ w + b
        net = ResidualMLP(xtr.mean(0), xtr.std(0).clamp_min(1e-6), rtr.std(0).clamp_min(1e-6), hidden)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ((len(xtr) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    with torch.no_grad():
        best_r2 = block_r2(base_ho, yho, width)
    best = (sum(best_r2) / len(best_r2), {k: v.clone() for k, v in net.state_dict().items()}, best_r2)
    print(f"  mlp: ridge held-out mean R2 {best[0]:.4f}", flush=True)
    for epoch in range(epochs):
        t0 = time.perf_counter()
        net.train()
        for idx in torch.randperm(len(xtr)).split(batch):
            loss = (((net(xtr[idx]) - rtr[idx]) / net.r_std) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        net.eval()
        with torch.no_grad():
            r2 = block_r2(base_ho + net(xho), yho, width)
        mean = sum(r2) / len(r2)
        print(f"  mlp epoch {epoch}: held-out mean R2 {mean:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if mean > best[0]:
            best = (mean, {k: v.clone() for k, v in net.state_dict().items()}, r2)
    net.load_state_dict(best[1])
    return net, best[2]
