import subprocess
import sys

from conftest import ROOT


def test_generated_stubs_match_the_proto():
    """Stubs are generated, never edited: a fresh generation must equal what is committed."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_torch_code_never_imports_protobuf():
    for folder in ("mappings",):
        for path in (ROOT / folder).glob("*.py"):
            assert "_pb2" not in path.read_text(), f"{path} imports generated protobuf code"
    for path in (ROOT / "client").glob("*.py"):
        assert "kvferry.sidecar" not in path.read_text(), f"{path}: the client never imports the sidecar"
