import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT


def test_wheel_maps_folders_to_kvferry_subpackages(tmp_path):
    """A regular (non-editable) build puts everything under kvferry/: nothing generic lands top-level."""
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("kvferry-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"kvferry", next(t for t in top if t.endswith(".dist-info"))}
    for module in (
        "kvferry/mappings/lab/fit.py",
        "kvferry/mappings/apply.py",
        "kvferry/common/wire.py",
        "kvferry/sidecar/server.py",
        "kvferry/client/client.py",
        "kvferry/v1/translate_pb2.py",
        "kvferry/cli.py",
        "kvferry/commands/distill.py",
    ):
        assert module in names


SERVER_ONLY = ("grpc_health", "grpc_reflection", "redis")  # tqdm is gone from ours, but transformers requires it


def _requirement_closure(name: str) -> list:
    """The installed distributions ``pip install name`` (no extras) would bring, resolved from their metadata."""
    import importlib.metadata as md
    import re

    from packaging.requirements import Requirement

    seen, todo = {}, [name]
    while todo:
        dist = md.distribution(todo.pop())
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in seen:
            continue
        seen[key] = dist
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def test_the_client_installs_and_imports_without_the_server_stack(tmp_path):
    """`pip install kvferry` is the client: its requirements name none of the server's packages (they come with the
    `server` extra), and in a fresh venv holding only what those requirements bring (linked from this one, so the
    test needs no network) the client, importers, cascade, rollout, direct reader and map math import."""
    import os
    import venv

    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "wheel"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "wheel").glob("kvferry-*.whl")
    meta = next(
        zipfile.ZipFile(wheel).read(n).decode() for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA")
    )
    base = [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    for pkg in ("grpcio-health-checking", "grpcio-reflection", "redis", "tqdm"):
        assert not any(line.split()[1].startswith(pkg) for line in base), f"{pkg} is a base requirement: {base}"
        assert any(line.split()[1].startswith(pkg) and 'extra == "server"' in line for line in meta.splitlines()), pkg
    assert "Requires-Python: >=3.11" in meta

    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    (site,) = env.glob("lib/python3*/site-packages")
    for dist in _requirement_closure("kvferry"):
        if dist.metadata["Name"] == "kvferry":
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    with zipfile.ZipFile(wheel) as z:  # install our wheel by unpacking it (what pip does for a pure wheel)
        z.extractall(site)
    python = env / "bin" / "python"
    probe = f"""
import importlib.util, sys
absent = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is not None]
assert not absent, absent
import kvferry.client.client, kvferry.client.importers, kvferry.client.cascade, kvferry.client.rollout
import kvferry.client.direct, kvferry.mappings.apply
from kvferry import paths
# installed, the root never depends on the folder it runs in (this one looks like a checkout)
assert paths.repo_root() == __import__('pathlib').Path(sys.argv[1]) / "kvferry", paths.repo_root()
print('ok')
"""
    work = tmp_path / "work"
    (work / "models" / "tokenizer").mkdir(parents=True)  # a decoy checkout in the working directory
    r = subprocess.run(
        [str(python), "-c", probe, str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=work,
        env={
            **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVFERRY_HOME")},
            "XDG_DATA_HOME": str(tmp_path / "data"),
        },
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_the_command_line_parser_imports_no_torch():
    """`kvferry --help` builds every subcommand's flags; none of it needs torch, grpc or transformers, so it stays
    fast (the heavy imports happen in the command that runs)."""
    import subprocess
    import sys

    code = (
        "import sys, kvferry.cli as c; c.build_parser(); "
        "print(sorted(m for m in ('torch', 'grpc', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_public_names_import_from_the_packages():
    """`from kvferry.client import TranslateClient, Cascade, ...` and the same for kvferry.sidecar and
    kvferry.mappings: every name in each package's __all__ resolves, and is the object its module defines."""
    import importlib

    for package in ("kvferry.client", "kvferry.sidecar", "kvferry.mappings"):
        mod = importlib.import_module(package)
        assert mod.__all__
        for name in mod.__all__:
            obj = getattr(mod, name)
            assert getattr(obj, "__name__", name) == name or callable(obj), (package, name)
        with pytest.raises(AttributeError):
            _ = mod.no_such_name
    from kvferry.client import Cascade, TranslateClient
    from kvferry.mappings import Gates, fit_pair
    from kvferry.sidecar import BackgroundSidecar, SidecarConfig

    assert all(callable(c) for c in (Cascade, TranslateClient, Gates, fit_pair, BackgroundSidecar, SidecarConfig))


def test_every_command_prints_its_help():
    """Each command's and bench's --help renders (argparse formats help text with %: a stray % in a docstring that
    feeds a flag's help broke `kvferry serve --help`)."""
    import argparse

    from kvferry.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: str) -> int:
        assert parser.format_help(), path
        count = 1
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    count += walk(sub, f"{path} {name}")
        return count

    assert walk(build_parser(), "kvferry") > 20
