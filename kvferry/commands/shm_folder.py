"""`kvferry shm-folder PATH`: prepare the response regions' shared folder (the chart's init container runs it)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "shm-folder",
        help="create the response regions' folder on the shared memory volume, group-writable, sticky and set-group-ID "
        "(kvferry.common.region_format.REGION_FOLDER_MODE)",
    )
    p.add_argument("path", help="an absolute path on the volume both containers mount, e.g. /kvferry-shm/regions")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from kvferry.common.region_format import REGION_FOLDER_MODE, prepare_region_folder

    print(f"{prepare_region_folder(a.path)}: mode {oct(REGION_FOLDER_MODE)}")
    return 0
