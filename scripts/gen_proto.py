"""Generate the Python stubs for proto/kvferry/v1/*.proto (grpcio-tools), or check them for drift.

python scripts/gen_proto.py          # regenerate in place
python scripts/gen_proto.py --check  # exit 1 if the committed stubs differ from a fresh generation
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto"
OUT_FILES = ("translate_pb2.py", "translate_pb2.pyi", "translate_pb2_grpc.py")


def generate(out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    sources = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "kvferry" / "v1").glob("*.proto"))
    rc = protoc.main(
        [
            "protoc",
            f"-I{PROTO}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *sources,
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if not a.check:
        generate(PROTO)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        drift = [
            f
            for f in OUT_FILES
            if not (PROTO / "kvferry/v1" / f).exists()
            or not filecmp.cmp(Path(tmp) / "kvferry/v1" / f, PROTO / "kvferry/v1" / f, shallow=False)
        ]
    if drift:
        print(
            f"generated stubs drifted from proto/: {', '.join(drift)}; run `python scripts/gen_proto.py`",
            file=sys.stderr,
        )
        return 1
    print("stubs match proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
