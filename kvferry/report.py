"""A map as the commands and demos print it: its evidence's tables, the serving gate's verdict, and the whole
inspection of an artifact (`kvferry maps inspect`)."""

from __future__ import annotations


def print_evidence(ms, summary: list[str], verdict: bool = True) -> list[str]:
    """Print ``ms``'s evidence (after the ``summary`` lines) and, with ``verdict``, the gate's; return the gate's
    failures (empty: it serves)."""
    from kvferry.mappings.gates import Gates
    from kvferry.mappings.lab.completion import format_completion_table
    from kvferry.mappings.lab.copy_probe import format_copy_table
    from kvferry.mappings.lab.evaluate import format_table
    from kvferry.mappings.lab.next_line import format_next_line_table

    ev = ms.evidence or {}
    print(
        f"== {ms.name} {ms.version}: evidence from `kvferry eval` (in its manifest; forwards in "
        f"{ev.get('precision', 'float32')})"
    )
    for line in summary:
        print("   " + line)
    tables = (
        ("arms" in ev, lambda: format_table(ev, "   next-token arms on held-out code (vs the target's full prefill)")),
        ("prose" in ev, lambda: format_table(ev["prose"], "   next-token arms on held-out English prose")),
        (
            "copy" in ev,
            lambda: format_copy_table(
                ev["copy"], "   copy probe on code (continuing a passage seen <gap> tokens earlier)"
            ),
        ),
        ("copy" in ev.get("prose", {}), lambda: format_copy_table(ev["prose"]["copy"], "   copy probe on prose")),
        (
            "completion" in ev,
            lambda: format_completion_table(
                ev["completion"], "   completion task (the first line of a function's body, exact match)"
            ),
        ),
        (
            "next_line" in ev,
            lambda: format_next_line_table(
                ev["next_line"], "   next-line task (a file's next line after 2,000+ tokens of it)"
            ),
        ),
    )
    for present, table in tables:
        if present:
            print(table())
    problems = Gates().failures(ev)
    if verdict:
        print("   serving gate:", "PASS" if not problems else "REFUSED: " + "; ".join(problems), "\n", flush=True)
    return problems


def print_cascade_path(res, ms, target_model, ids, src_kv, refresh: int, new_tokens: int, pad: int, describe) -> None:
    """After a cascade's answer ``res``: the path it took and why; when it fell back, what the map would have said
    (applied in-process to the source's cache ``src_kv``, never served), with ``describe(tokens)`` as its text."""
    from kvferry.mappings.apply import apply
    from kvferry.mappings.cache import kv_slice
    from kvferry.mappings.lab.evaluate import greedy_continuation

    print(f"      path: {res.path} ({res.reason[:240]}{'…' if len(res.reason) > 240 else ''})", flush=True)
    if res.path != "mapped":
        n = ids.shape[1]
        forced = greedy_continuation(target_model, ids, apply(ms, kv_slice(src_kv, 0, n - refresh), 0), new_tokens, pad)
        print(f"      what the refused map would have said (in-process, never served): {describe(forced)}", flush=True)


def print_inspection(ms, brief: bool = False) -> None:
    """`kvferry maps inspect`: ``ms``'s provenance, per-layer held-out R² (from its fit), evidence (all but its
    tables with ``brief``) and gate verdict with the gated measures' intervals, all read from its manifest."""
    from kvferry.mappings.gates import Gates

    tl = ms.target.geometry.layers
    print(
        f"{ms.name} {ms.version}: {ms.source.name} ({ms.source.geometry.layers} layers) -> {ms.target.name} ({tl} "
        "layers), "
        f"{str(ms.dtype).removeprefix('torch.')}, fitted on {ms.calibration.get('tokens', '?')} tokens"
    )

    def r2_line(label: str, r2: dict[int, float]) -> str:
        def cell(x):
            return "n/a" if x is None or x != x else f"{x:.2f}"  # n/a: not measured (absent or NaN)

        return label + ", ".join(cell(r2.get(t)) for t in range(tl))

    if ms.basis is not None:
        from kvferry.mappings.lab.fit import format_curve

        sw = ms.source.geometry.kv_width
        print(
            f"shared basis: rank {ms.basis.rank} over source layers {_spans(ms.basis.source_layers)} "
            f"({'+'.join(c.upper() for c in ms.basis.inputs)}), every target map reads it; "
            f"{ms.flops_per_token / 1e6:.1f} MFLOP per token ({sw} features per source layer and kind)"
            + (
                f"; a code MLP of {ms.basis.mlp.hidden} hidden units refines the code"
                if ms.basis.mlp is not None
                else ""
            )
        )
        if ms.fit.get("rank_curve") and not brief:
            print("the fit's cost/quality curve (held-out R², fitted on the training rows):")
            print(format_curve(ms.fit["rank_curve"]))
    for kind in ("k", "v"):
        print(
            r2_line(
                f"held-out R² of {kind.upper()} by target layer: ",
                {t: ms.maps[(t, kind)].heldout_r2 for t in range(tl)},
            )
        )
    if "distilled" in ms.fit:
        d = ms.fit["distilled"]
        print(
            f"distilled through the target from version {d.get('base_version', '?')} (layers >= "
            f"{d.get('from_layer', '?')}, "
            f"{d.get('epochs', '?')} epochs): their fit R² is n/a; `kvferry eval` measures them"
        )
        held = [f"{e['held_kl']:.4f}" for e in d.get("log", []) if "held_kl" in e]
        if held:
            print(f"held-out tail KL by epoch (0: the starting map): {', '.join(held)}")
        measured = (ms.evidence or {}).get("layers", [])
        for kind in ("k", "v"):
            r2 = {r["layer"]: r["r2"] for r in measured if r["kind"] == kind}
            if r2:
                print(r2_line(f"R² of {kind.upper()} by target layer on the evaluation's held-out prompts: ", r2))
    windowed = sorted(f"{t}{kind.upper()}" for (t, kind), m in ms.maps.items() if m.window > 1)
    if windowed:
        print(
            f"windowed maps (read the {ms.context} source tokens before each token; translate from position 0): "
            + ", ".join(windowed)
        )
    if ms.evidence and not brief:
        print_evidence(ms, [], verdict=False)
    gates = Gates()
    if ms.evidence and "arms" in ms.evidence:
        measured = [c for c in gates.checks(ms.evidence)[1] if c.interval is not None]
        if measured:
            print(
                f"gated measures with their 95% intervals over prompts (paired bootstrap; a marginal measure, its bar "
                f"inside its interval: {gates.marginal}, the default policy):"
            )
            for c in measured:
                state = "marginal" if c.marginal else "pass" if c.passes else "fail"
                print(
                    f"  {c.where}: {c.measure} {c.value:.3f} [{c.interval.low:.3f}, {c.interval.high:.3f}], "
                    f"bar {'>=' if c.at_least else '<='} {c.bar}: {state}"
                )
    serves, problems = gates.verdict(ms.evidence)
    print("serving gates (defaults): " + ("pass" if serves else "fail: " + "; ".join(problems)))


def _spans(layers) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    out, layers = [], sorted(layers)
    for layer in layers:
        if out and layer == out[-1][1] + 1:
            out[-1][1] = layer
        else:
            out.append([layer, layer])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)
