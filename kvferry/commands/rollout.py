"""`kvferry rollout`: one map's entry in a rollout policy file."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    r = sub.add_parser(
        "rollout", help="change one map's entry in a rollout policy file (canary, version pin, kill switch)"
    )
    r.add_argument("policy", type=Path, help="the policy TOML the engines' PolicyStore watches")
    r.add_argument("map", help="map name, <source>__<target>")
    r.add_argument("--version", default=None, help='pin a version (a rollback is pinning the previous one) or "latest"')
    r.add_argument("--canary", type=float, default=None, help="percent of eligible requests on the mapped path")
    r.add_argument("--shadow", type=float, default=None, help="percent of mapped requests shadow-checked")
    r.add_argument("--min-tokens", type=int, default=None)
    r.add_argument("--refresh", type=int, default=None)
    onoff = r.add_mutually_exclusive_group()
    onoff.add_argument("--enable", action="store_true", help="kill switch off (mapping allowed)")
    onoff.add_argument("--disable", action="store_true", help="kill switch on: every request takes the full prefill")
    r.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from kvferry.client.rollout import update_policy_file

    enabled = True if a.enable else False if a.disable else None
    entry = update_policy_file(
        a.policy,
        a.map,
        enabled=enabled,
        version=a.version,
        canary_percent=a.canary,
        shadow_percent=a.shadow,
        min_tokens=a.min_tokens,
        refresh=a.refresh,
    )
    print(f"{a.policy}: {a.map} -> {entry}")
    return 0
