"""``kvferry demo``: the main job end to end.

By default (``--family all``) the Qwen2.5-Coder pair (:mod:`kvferry.demo_qwen`), then the SmolLM2 depth cuts
(:mod:`kvferry.demo_real`; ``--family real`` alone). If a real model cannot be installed, or with ``--family tiny``,
the shipped tiny family:

1. Fit S->T and S->T64 on the shipped calibration split, evaluate each on held-out text, write
   the evidence into the artifacts, print the evidence tables and the gate verdicts.
2. Start the gRPC sidecar on those maps (a real server on a loopback port).
3. Cascade: S prefills a long prompt (a key->value table, held-out code, then a query); its cache
   goes through the sidecar; T imports it, refreshes the last r tokens and generates. Print T's
   generation next to its own full-prefill generation, their agreement, and TTFT for both paths.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch

from kvferry import paths


def _fit_and_eval(source, target, out, prompts: int, quiet: bool):
    from kvferry.mappings.artifact import save, write_evidence
    from kvferry.mappings.gates import Gates
    from kvferry.mappings.lab.evaluate import EvalSettings, evaluate, format_table
    from kvferry.mappings.lab.fit import FitSettings, fit_pair

    print(f"== fit {source.identity.name} -> {target.identity.name} on data/calib.jsonl", flush=True)
    t0 = time.perf_counter()
    ms = fit_pair(source, target, [str(paths.data_file("calib.jsonl"))], FitSettings(), progress=not quiet)
    dest = save(ms, out)
    print(
        f"   fitted {len(ms.maps)} maps from {ms.calibration['tokens']} tokens in {time.perf_counter() - t0:.1f}s -> "
        f"{dest}"
    )
    ev = evaluate(
        ms,
        source,
        target,
        [str(paths.data_file("heldout.jsonl"))],
        EvalSettings(prompts=prompts, recall_prompts=min(prompts, 50), greedy_prompts=min(prompts, 16)),
        progress=not quiet,
    )
    write_evidence(dest, ev)
    print(
        format_table(
            ev, f"{ms.name} {ms.version}: evidence on held-out text ({prompts} prompts, r={ev['recommended_refresh']})"
        )
    )
    from kvferry.mappings.lab.copy_probe import format_copy_table

    print(
        format_copy_table(
            ev["copy"],
            "   long-range copy probe (the tiny family does not copy at these distances: the gate calls it n/a)",
        )
    )
    problems = Gates().failures(ev)
    print("   gates:", "PASS" if not problems else "FAIL: " + "; ".join(problems), "\n", flush=True)
    return ms


def _long_prompt(tokenizer) -> tuple[str, str]:
    """A recall prompt padded with held-out code to ~480 tokens, and its answer."""
    from kvferry.mappings.lab.capture import read_corpus
    from kvferry.mappings.lab.recall import make_probe, probe_fillers

    texts = list(read_corpus([paths.data_file("heldout.jsonl")]))
    fillers = probe_fillers(texts, tokenizer, count=8, min_tokens=200, seed=11)
    long_filler = "\n".join(fillers)
    ids = tokenizer(long_filler, add_special_tokens=False)["input_ids"][:330]
    ex = make_probe([tokenizer.decode(ids)], count=1, entries=10, seed=5)[0]
    return ex.prompt, ex.answer


def run(a: argparse.Namespace) -> int:
    """The Qwen2.5-Coder pair first, then the fast fixtures: SmolLM2 depth cuts (or the tiny family when a real model
    cannot be installed here)."""
    from kvferry.mappings.errors import InvalidInput

    if a.family in ("all", "qwen"):
        from kvferry import demo_qwen

        try:
            demo_qwen.run(a)
        except (InvalidInput, OSError, ImportError) as e:
            print(f"== the Qwen2.5-Coder pair could not run here ({e})\n", flush=True)
        if a.family == "qwen":
            return 0
    if a.family in ("all", "real"):
        from kvferry import demo_real

        print(
            "== fast fixtures: SmolLM2-135M and its depth cuts (a cut's source is the target's own first layers)\n",
            flush=True,
        )
        try:
            return demo_real.run(a)
        except demo_real.RealModelUnavailable as e:
            print(f"== the real model is not available here ({e}); running the tiny test family instead\n", flush=True)
        except InvalidInput as e:
            print(f"== the real pair could not run ({e}); running the tiny test family instead\n", flush=True)
    return run_tiny(a)


def run_tiny(a: argparse.Namespace) -> int:
    from kvferry.client.cascade import Cascade
    from kvferry.client.client import ClientOptions, TranslateClient
    from kvferry.client.rollout import MapRollout
    from kvferry.mappings.lab.capture import capture_kv, load_model
    from kvferry.quiet import quiet_transformers
    from kvferry.sidecar.background import BackgroundSidecar
    from kvferry.sidecar.config import SidecarConfig

    quiet_transformers()
    out = a.out / "maps"
    shutil.rmtree(out, ignore_errors=True)
    source = load_model(paths.model_dir("S"))
    target = load_model(paths.model_dir("T"))
    ms = _fit_and_eval(source, target, out, a.prompts, a.quiet)
    _fit_and_eval(source, load_model(paths.model_dir("T64")), out, a.prompts, a.quiet)

    print("== sidecar + cascade", flush=True)
    with BackgroundSidecar(SidecarConfig(maps_dir=str(out), port=0, reload_seconds=0)) as sc:
        listed = [
            f"{e.maps.name} {e.maps.version}" + ("" if e.servable else " (gated off)")
            for e in sc.sidecar.registry.entries()
        ]
        print(f"   sidecar on {sc.address}: {', '.join(listed)}")
        force = not any(e.servable and e.maps.name == ms.name for e in sc.sidecar.registry.entries())
        if force:
            print("   S__T is gated off by its evidence; the cascade below will fall back to T's own prefill.")
        prompt, answer = _long_prompt(target.tokenizer)
        ids = target.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        n = ids.shape[1]
        with TranslateClient(ClientOptions(target=sc.address)) as client:
            cascade = Cascade(
                target.model, client, ms.name, MapRollout(version=ms.version, refresh=16), source.identity
            )
            t0 = time.perf_counter()
            with torch.no_grad():
                src_kv = capture_kv(source.model, ids)
            source_prefill = time.perf_counter() - t0
            cascade.generate(ids, src_kv, 4)  # warm-up (channel, allocator)
            cascade.full_prefill(ids, 4)
            mapped = cascade.generate(ids, src_kv, 32)
            gold = cascade.full_prefill(ids, 32)

    def dec(t):
        return target.tokenizer.decode(t)

    agree = sum(x == y for x, y in zip(mapped.tokens, gold.tokens)) / len(gold.tokens)
    print(f"   prompt: {n} tokens (a {10}-entry key->value table, held-out code, then a query; answer {answer!r})")
    print(f"   S prefill (the source reads the prompt anyway): {source_prefill * 1e3:.1f} ms")
    print(f"   path taken: {mapped.path} ({mapped.reason})")
    print(f"   T full prefill : TTFT {gold.ttft_seconds * 1e3:7.1f} ms  -> {json.dumps(dec(gold.tokens))}")
    print(f"   T via kvferry  : TTFT {mapped.ttft_seconds * 1e3:7.1f} ms  -> {json.dumps(dec(mapped.tokens))}")
    if mapped.translate is not None:
        t = mapped.timings
        print(
            f"                    (translate {t['translate'] * 1e3:.1f} ms over gRPC, import {t['import'] * 1e3:.1f} "
            "ms, "
            f"refresh + first token {t['refresh_first_token'] * 1e3:.1f} ms; "
            f"{mapped.translate.stats.bytes_in / 2**20:.2f} MiB in)"
        )
    if mapped.drift is not None:
        print(
            f"   drift signal (free, on the {mapped.drift.tokens} refreshed tokens): attention-output cosine "
            f"{mapped.drift.mean_attn_cos:.3f}, K/V relative error {mapped.drift.mean_rel_err:.3f}"
        )
    print(f"   greedy agreement over 32 tokens: {agree:.2f}")
    print(
        f"   recall answer: full prefill {'correct' if dec(gold.tokens).startswith(answer) else 'wrong'}, "
        f"kvferry {'correct' if dec(mapped.tokens).startswith(answer) else 'wrong'}"
    )
    print("   (at these tiny sizes prefill is cheap; `kvferry bench translate` measures TTFT at n=512..8192)")
    return 0
