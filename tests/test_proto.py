import subprocess
import sys

from conftest import ROOT


def test_generated_stubs_match_the_proto():
    """Stubs are generated, never edited: a fresh generation must equal what is committed."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
