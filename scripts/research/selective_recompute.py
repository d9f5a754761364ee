"""Selective recompute (CacheBlend-style) on top of a mapped cache: how large a share must the target redo?

The target recomputes a share of the prefix tokens through all of its layers; each chosen token attends to the
mapped cache of the others (and to the other chosen tokens' fresh KV), and its fresh K/V replace the mapped ones.
Then, as in the gate's arm, the target recomputes the last r prompt tokens. Compute of the recompute is about
``share`` of a prefill (plus attention over the whole prefix), so the saving is ``1 - share`` at best.

Token choice:
  stride   evenly spaced tokens (no knowledge of the target; what a sidecar could do blind)
  oracle   the tokens whose mapped K/V deviate most from the target's own, summed over layers (needs the target's
           prefill, so it is an upper bound on what any deviation-guided choice can reach, not a deployable arm)

Writes JSON and a markdown table (``--out``). Example:
    python scripts/research/selective_recompute.py --map maps/smollm2-135m-l10__smollm2-135m/0.1.0 \
        --gaps 500,1000,3000 --prompts 4 --shares 0.05,0.15,0.3,0.5 --out runs/results/selective_recompute
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tables import write_results  # scripts/research/tables.py (beside this script)
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvferry import paths
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.capture import capture_kv, kv_slice, load_model, read_corpus, token_stream
from kvferry.mappings.copy_probe import CopySettings, continuation_accuracy, make_examples


@torch.no_grad()
def recompute(model, kv: list, ids: list[int], chosen: torch.Tensor) -> list:
    """``kv`` with the chosen positions' K/V recomputed by ``model`` through every layer."""
    m = model.model
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    n, s = kv[0][0].shape[2], len(chosen)
    h = m.embed_tokens(torch.tensor([ids])[:, chosen])
    cos, sin = m.rotary_emb(h, position_ids=chosen[None])
    mask = chosen[:, None] >= torch.arange(n)[None, :]
    out = []
    for layer, (K, V) in zip(m.layers, kv):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, s, heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(1, s, kv_heads, d).transpose(1, 2)
        v = attn.v_proj(x).view(1, s, kv_heads, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        K, V = K.clone(), V.clone()
        K[:, :, chosen], V[:, :, chosen] = k, v
        out.append((K, V))
        g = heads // kv_heads
        o = F.scaled_dot_product_attention(q, K.repeat_interleave(g, 1), V.repeat_interleave(g, 1), attn_mask=mask,
                                           scale=attn.scaling)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(1, s, heads * d))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return out


def stride_choice(n: int, share: float) -> torch.Tensor:
    k = max(1, round(share * n))
    return torch.unique(torch.linspace(0, n - 1, k).round().long())


def oracle_choice(mapped: list, gold: list, share: float) -> torch.Tensor:
    n = mapped[0][0].shape[2]
    dev = torch.zeros(n)
    for (mk, mv), (gk, gv) in zip(mapped, gold):
        for a, b in ((mk, gk), (mv, gv)):
            dev += ((a - b).pow(2).sum((0, 1, 3)) / b.pow(2).sum((0, 1, 3)).clamp_min(1e-9))
    k = max(1, round(share * n))
    return torch.sort(torch.topk(dev, k).indices).values


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=paths.model_dir("pretrained") / "smollm2-135m")
    ap.add_argument("--gaps", default="500,1000,3000")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--shares", default="0.05,0.15,0.3,0.5")
    ap.add_argument("--refresh", type=int, default=16)
    ap.add_argument("--seed", type=int, default=11, help="differs from the evidence's seed: these prompts are fresh")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/results/selective_recompute"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shares = [float(x) for x in a.shares.split(",")]
    gaps = tuple(int(g) for g in a.gaps.split(","))
    target = load_model(a.target)
    ms = load(a.map)
    source = load_model(paths.model_dir("pretrained") / ms.source.name, ms.source.name)
    stream = token_stream(target.tokenizer, read_corpus([paths.data_file("heldout.jsonl")]))
    exs = make_examples(stream, CopySettings(gaps=gaps, prompts=a.prompts, seed=a.seed, refresh=a.refresh))
    r = a.refresh
    sums: dict[tuple[int, str], float] = {}
    t0 = time.perf_counter()
    for i, ex in enumerate(exs):
        n = len(ex.prompt)
        head = ex.prompt[: n - r]
        mapped = kv_slice(apply(ms, capture_kv(source.model, torch.tensor([ex.prompt[:-1]])), 0), 0, n - r)
        gold = capture_kv(target.model, torch.tensor([head]))
        row = {"full": continuation_accuracy(target.model, None, ex.prompt, ex.answer),
               f"truncate_{r}": continuation_accuracy(target.model, None, ex.prompt[n - r:], ex.answer),
               f"mapped+refresh_{r}": continuation_accuracy(target.model, mapped, ex.prompt[n - r:], ex.answer)}
        for share in shares:
            for how, chosen in (("stride", stride_choice(n - r, share)), ("oracle", oracle_choice(mapped, gold, share))):
                kv = recompute(target.model, mapped, head, chosen)
                row[f"{how}_{share:g}+refresh_{r}"] = continuation_accuracy(target.model, kv, ex.prompt[n - r:], ex.answer)
        for k, v in row.items():
            sums[(ex.gap, k)] = sums.get((ex.gap, k), 0.0) + v
        print(f"[{i + 1}/{len(exs)}] gap {ex.gap}: " + " ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
    arms = list(dict.fromkeys(k for _, k in sums))
    result = {"settings": {"map": str(a.map), "gaps": list(gaps), "prompts": a.prompts, "shares": shares,
                           "refresh": r, "seed": a.seed},
              "seconds": time.perf_counter() - t0,
              "gaps": {str(g): {k: sums[(g, k)] / a.prompts for k in arms} for g in gaps}}
    write_results(a.out, result, gaps, arms)


if __name__ == "__main__":
    main()
