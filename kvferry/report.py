"""A map's evidence as the demos print it: its tables, and the serving gate's verdict."""

from __future__ import annotations


def print_evidence(ms, summary: list[str], verdict: bool = True) -> list[str]:
    """Print ``ms``'s evidence (after the ``summary`` lines) and, with ``verdict``, the gate's; return the gate's
    failures (empty: it serves)."""
    from kvferry.mappings.completion import format_completion_table
    from kvferry.mappings.copy_probe import format_copy_table
    from kvferry.mappings.evaluate import format_table
    from kvferry.mappings.gates import Gates
    from kvferry.mappings.next_line import format_next_line_table

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
    from kvferry.mappings.capture import kv_slice
    from kvferry.mappings.evaluate import greedy_continuation

    print(f"      path: {res.path} ({res.reason[:240]}{'…' if len(res.reason) > 240 else ''})", flush=True)
    if res.path != "mapped":
        n = ids.shape[1]
        forced = greedy_continuation(target_model, ids, apply(ms, kv_slice(src_kv, 0, n - refresh), 0), new_tokens, pad)
        print(f"      what the refused map would have said (in-process, never served): {describe(forced)}", flush=True)
