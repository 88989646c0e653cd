"""Check that kpt's distributions are installed from wheel files, not from the source tree.

    python scripts/installed_from_wheels.py kpt-core kpt-cuda ...

For each distribution named: pip recorded a wheel file as its origin (``direct_url.json``), and
every module it provides imports from the installed files, not from packages/<name>/src. Run by
``nox -s wheels`` before the tests, so that they test what a user installs. Exits non-zero naming
each distribution that fails.
"""

from __future__ import annotations

import importlib
import json
import sys
from importlib import metadata
from pathlib import Path


def problems(name: str) -> list[str]:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return [f"{name}: not installed"]
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    found = []
    if not origin.get("url", "").endswith(".whl"):
        found.append(f"{name}: installed from {origin.get('url') or 'an index'}, not a wheel file")
    top_level = {f.parts[0] for f in dist.files or () if f.suffix == ".py" and len(f.parts) > 1}
    for module in sorted(top_level):
        path = Path(importlib.import_module(module).__file__ or "").resolve()
        if not path.is_relative_to(Path(str(dist.locate_file(""))).resolve()):
            found.append(f"{name}: {module} imports from {path}, not from the installed wheel")
    return found


def main(names: list[str]) -> int:
    found = [p for name in names for p in problems(name)]
    print("\n".join(found) or f"installed from wheels: {', '.join(names)}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
