"""``--serve-refused-maps``: the one switch that lets a bench time a map whose evidence fails its gate.

The gate refuses a map whose quality is not shown. A bench measures speed, and may need to time such a map (the Qwen
pair's, while none passes). It does so only with this flag: never a default, never the chart's (the chart refuses
``sidecar.forceMaps`` without ``allowInsecure``), and a run with it says so in the first line of its table and in its
JSON (``refused_map_served``: the map, its version and why its gate refuses it).
"""

from __future__ import annotations

from pathlib import Path

FLAG = "--serve-refused-maps"


def add_flag(parser) -> None:
    parser.add_argument(
        FLAG,
        dest="serve_refused_maps",
        action="store_true",
        help="time the map even if its gate refuses it (speed only; every result names the refused map): "
        "never a default",
    )


def bench_map(maps_dir: Path, name: str, version: str, serve_refused: bool):
    """The map a bench times, and (where its gate refuses it and ``serve_refused``) the line that says so; a refused
    map without ``serve_refused`` ends the bench with what to do."""
    from kvferry.sidecar.registry import MapRegistry

    registry = MapRegistry(maps_dir, force=True)  # every loadable map, each with its gate's verdict
    registry.scan()
    ms = registry.resolve(name, version)
    entry = next(e for e in registry.entries(name) if e.maps.name == name and e.maps.version == ms.version)
    if not entry.reason:
        return ms, None
    if not serve_refused:
        raise SystemExit(
            f"kvferry bench: the gate refuses {name} {ms.version} ({entry.reason}); a bench may time it only with "
            f"{FLAG}, and then says so in every result"
        )
    return ms, f"{name} {ms.version}: {entry.reason}"


def banner(served: str | None) -> str:
    """The first line of a table whose map its gate refuses ("" when it serves)."""
    if served is None:
        return ""
    return f"SERVING A MAP ITS GATE REFUSES ({FLAG}): {served}. These numbers are speed, not a map that may serve."
