"""A map's evidence as the demos print it: its tables, and the serving gate's verdict."""

from __future__ import annotations


def print_evidence(ms, summary: list[str]) -> list[str]:
    """Print ``ms``'s evidence (after the ``summary`` lines) and return the gate's failures (empty: it serves)."""
    from kvferry.mappings.completion import format_completion_table
    from kvferry.mappings.copy_probe import format_copy_table
    from kvferry.mappings.evaluate import format_table
    from kvferry.mappings.gates import Gates

    ev = ms.evidence or {}
    print(f"== {ms.name} {ms.version}: evidence from `kvferry eval` (in its manifest)")
    for line in summary:
        print("   " + line)
    tables = (("arms" in ev, lambda: format_table(ev, "   next-token arms on held-out code (vs the target's full prefill)")),
              ("prose" in ev, lambda: format_table(ev["prose"], "   next-token arms on held-out English prose")),
              ("copy" in ev, lambda: format_copy_table(ev["copy"], "   copy probe on code (continuing a passage seen "
                                                                    "<gap> tokens earlier)")),
              ("copy" in ev.get("prose", {}), lambda: format_copy_table(ev["prose"]["copy"], "   copy probe on prose")),
              ("completion" in ev, lambda: format_completion_table(ev["completion"], "   completion task (the first "
                                                                   "line of a function's body, exact match)")))
    for present, table in tables:
        if present:
            print(table())
    problems = Gates().failures(ev)
    print("   serving gate:", "PASS" if not problems else "REFUSED: " + "; ".join(problems), "\n", flush=True)
    return problems
