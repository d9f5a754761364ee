"""`kvferry maps`: a map artifact inspected (provenance, fit, evidence, gate verdict), or a bundle fetched."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    mps = sub.add_parser("maps", help="map artifacts: inspect one, fetch a bundle")
    mpsub = mps.add_subparsers(dest="maps_action", required=True)
    ins = mpsub.add_parser(
        "inspect", help="a map artifact's provenance, per-layer held-out R², evidence and gate verdict"
    )
    ins.add_argument("artifact", type=Path, help="maps/<source>__<target>/<version>")
    ins.add_argument("--brief", action="store_true", help="leave out the evidence's tables")
    ins.set_defaults(func=run_inspect)
    fm = mpsub.add_parser(
        "fetch", help="download and unpack a .tar.gz of map artifacts, verifying each (init containers)"
    )
    fm.add_argument("--url", required=True)
    fm.add_argument("--dest", type=Path, required=True)
    fm.set_defaults(func=run_fetch)


def run_inspect(a: argparse.Namespace) -> int:
    """A map artifact's provenance, per-layer held-out R² (from its fit) and gate verdict, read from the manifest."""
    from kvferry.mappings.artifact import load
    from kvferry.report import print_inspection

    print_inspection(load(a.artifact), brief=a.brief)
    return 0


def run_fetch(a: argparse.Namespace) -> int:
    from kvferry.fetch_maps import fetch

    for p in fetch(a.url, a.dest):
        print(f"fetched and verified {p}")
    return 0
