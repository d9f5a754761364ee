import subprocess
import sys
import zipfile

from conftest import ROOT


def test_wheel_maps_folders_to_kvferry_subpackages(tmp_path):
    """A regular (non-editable) build puts everything under kvferry/: nothing generic lands top-level."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("kvferry-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"kvferry", next(t for t in top if t.endswith(".dist-info"))}
    for module in ("kvferry/mappings/fit.py", "kvferry/common/wire.py", "kvferry/sidecar/server.py", "kvferry/client/client.py",
                   "kvferry/v1/translate_pb2.py", "kvferry/cli.py"):
        assert module in names
