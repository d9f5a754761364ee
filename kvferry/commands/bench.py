"""`kvferry bench ...`: the benchmarks (each writes JSON and a table); each registers its own subcommand."""

from __future__ import annotations


def add_parser(sub) -> None:
    from kvferry.bench import apply_cost, hits, load, maps, rollout, translate, vllm_ttft

    b = sub.add_parser("bench", help="benchmarks (JSON + a table)")
    bsub = b.add_subparsers(dest="bench", required=True)
    translate.add_parser(bsub)
    maps.add_parser(bsub)
    apply_cost.add_parser(bsub)
    hits.add_parser(bsub)
    load.add_parser(bsub)
    rollout.add_parser(bsub)
    vllm_ttft.add_parser(bsub)
