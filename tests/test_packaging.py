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


SERVER_ONLY = ("grpc_health", "grpc_reflection", "redis", "tqdm")


def test_the_client_installs_and_imports_without_the_server_stack(tmp_path):
    """`pip install kvferry` is the client: its requirements name none of the server's packages (they come with the
    `server` extra), and the client, importers, cascade, rollout and map math import with those packages blocked."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("kvferry-*.whl")
    meta = next(zipfile.ZipFile(wheel).read(n).decode() for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA"))
    base = [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    for pkg in ("grpcio-health-checking", "grpcio-reflection", "redis", "tqdm"):
        assert not any(line.split()[1].startswith(pkg) for line in base), f"{pkg} is a base requirement: {base}"
        assert any(line.split()[1].startswith(pkg) and 'extra == "server"' in line for line in meta.splitlines()), pkg
    assert "Requires-Python: >=3.11" in meta
    blocker = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {SERVER_ONLY!r}:
            raise ImportError('server-only package: ' + name)
sys.meta_path.insert(0, Block())
import kvferry.client.client, kvferry.client.importers, kvferry.client.cascade, kvferry.client.rollout
import kvferry.client.direct, kvferry.mappings.apply
leaked = sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_ONLY!r})
assert not leaked, leaked
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
