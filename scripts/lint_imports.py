"""Run import-linter's contracts (pyproject.toml [tool.importlinter]) over the package as it installs.

The repository maps folders to subpackages (pyproject's package-dir: sidecar/ is kvferry.sidecar), which an
editable install resolves with an import hook that import-linter's graph builder does not follow. This lays the
package out as a wheel would (symlinks under build/import-layout/) and runs `lint-imports` on that layout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    layout = ROOT / "build" / "import-layout"
    shutil.rmtree(layout, ignore_errors=True)
    for package in setuptools["packages"]:
        target = layout.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for f in (ROOT / _folder(package, setuptools["package-dir"])).glob("*.py"):
            (target / f.name).symlink_to(f)
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(layout)}
    return subprocess.run(
        [str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=layout, env=env
    ).returncode


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """Where ``package`` lives in the repository: its own package-dir entry, else its nearest listed parent's folder
    and the rest of its name as subfolders (kvferry.mappings.lab: mappings/lab)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in package_dir:
            return Path(package_dir[".".join(parts[:n])], *parts[n:])
    return Path(*parts)


if __name__ == "__main__":
    sys.exit(main())
