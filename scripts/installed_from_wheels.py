"""Check that kpt's distributions are installed from wheel files, complete, not from the source tree.

    python scripts/installed_from_wheels.py packages/kpt-core packages/kpt-cuda ...

For each package folder named: pip recorded a wheel file as the origin of its distribution
(``direct_url.json``); every file of the package's source (``src/``: modules, CUDA C and Metal
sources, tuning tables, ``py.typed``...) was installed with it, so package data left out of
``pyproject.toml`` is caught even where no test on this machine reads it (a ``.cu`` file runs
only on a GPU); and its modules import from the installed files, not from the source tree. Run
by ``nox -s wheels`` before the tests, so that they test what a user installs. Exits non-zero
naming each problem.
"""

from __future__ import annotations

import importlib
import json
import sys
import tomllib
from importlib import metadata
from pathlib import Path, PurePosixPath

SKIP = ("__pycache__", ".egg-info")  # build by-products beside the sources, never shipped


def source_files(package: Path) -> set[PurePosixPath]:
    """The package's files under src/, relative to src/ (as a wheel records them)."""
    src = package / "src"
    return {PurePosixPath(f.relative_to(src).as_posix()) for f in src.rglob("*")
            if f.is_file() and not any(part.endswith(SKIP) for part in f.relative_to(src).parts)}


def problems(package: Path) -> list[str]:
    name = tomllib.loads((package / "pyproject.toml").read_text())["project"]["name"]
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return [f"{name}: not installed"]
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    if not origin.get("url", "").endswith(".whl"):
        return [f"{name}: installed from {origin.get('url') or 'an index'}, not from a wheel file"]
    installed = {PurePosixPath(str(f)) for f in dist.files or ()}
    found = [f"{name}: {f} is in {package}/src but not in the wheel (package data?)"
             for f in sorted(source_files(package) - installed)]
    root = Path(str(dist.locate_file(""))).resolve()
    for module in sorted({f.parts[0] for f in installed if f.suffix == ".py" and len(f.parts) > 1}):
        path = Path(importlib.import_module(module).__file__ or "").resolve()
        if not path.is_relative_to(root):
            found.append(f"{name}: {module} imports from {path}, not from the installed wheel")
    return found


def main(packages: list[str]) -> int:
    found = [p for package in packages for p in problems(Path(package))]
    print("\n".join(found) or f"installed from complete wheels: {', '.join(packages)}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
