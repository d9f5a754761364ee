"""The research scripts' shared copy-probe table: one row per arm, accuracy per gap, retention against full prefill."""


def retention_table(by_gap: dict[str, dict[str, float]], gaps, arms) -> str:
    """Markdown: per arm its accuracy at each gap and its worst-gap share of full prefill's
    (``by_gap[str(gap)][arm]``)."""
    lines = [
        "| arm | " + " | ".join(f"gap {g}" for g in gaps) + " | retention (min over gaps) |",
        "|---|" + "---|" * (len(gaps) + 1),
    ]
    for k in arms:
        vals = [by_gap[str(g)][k] for g in gaps]
        ret = min(v / max(by_gap[str(g)]["full"], 1e-9) for v, g in zip(vals, gaps))
        lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {ret:.2f} |")
    return "\n".join(lines)


def write_results(out, result: dict, gaps, arms) -> None:
    """``out``.json (the whole result) and ``out``.md (the retention table), which is also printed."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = retention_table(result["gaps"], gaps, arms)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
