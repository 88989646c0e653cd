"""The import graph of the packages under ``packages/*/src``, read statically (with ``ast``, nothing
is imported), keeps two rules:

- kpt-core (``kpt.*``) imports no plugin package (any top-level package of another distribution
  under ``packages/``: kpt_triton, kpt_cuda, kpt_rocm, kpt_xpu, kpt_mps, kpt_fpga_sim,
  kpt_conformance), by any ``import`` or ``from ... import`` statement anywhere in a module, inside
  functions and under ``if TYPE_CHECKING:`` included. Plugins reach core through entry points.
- No circle among the modules of one package at module level: the statements run when a module is
  imported. Imports inside functions (run when the function is called) and under
  ``if TYPE_CHECKING:`` (never run) are left out of this check.

``from a import b`` counts as an import of the module ``a.b`` where that is a module of ours, else of
``a``; ``import a.b`` counts as an import of ``a.b`` (the parent packages it also runs are not
counted, or every package's ``__init__`` would close a circle with its own modules). Imports made
by name at run time (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
"""The repository's ``packages/`` folder."""

CORE = "kpt"


@dataclass(frozen=True)
class Import:
    """One import statement's target: the importing module, the module imported, where, and whether
    it runs when the importing module is imported (``module_level``)."""

    source: str
    target: str
    line: int
    module_level: bool


def modules(src_dirs: list[Path]) -> dict[str, Path]:
    """Every module under the ``src`` folders, by dotted name (a package by its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for src in src_dirs:
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            if not all(part.isidentifier() for part in parts):
                continue  # not importable (an egg-info folder, a build copy)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt], module_level: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """The import statements of ``body`` and whether each runs at import time: not inside a function,
    not under ``if TYPE_CHECKING:`` (its ``else`` branch does run)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, module_level
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _statements(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, False)
            yield from _statements(node.orelse, module_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    stmts = [c for c in children if isinstance(c, ast.stmt)]
                    for c in children:  # except handlers and match cases hold statements of their own
                        if isinstance(c, ast.excepthandler | ast.match_case):
                            stmts += c.body
                    yield from _statements(stmts, module_level)


def imports(known: dict[str, Path]) -> list[Import]:
    """Every import statement of the ``known`` modules, resolved to the modules of ours it names."""
    out: list[Import] = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node, module_level in _statements(tree.body, True):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    stem = ".".join([*base, node.module] if node.module else base)
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
            for target in dict.fromkeys(targets):
                out.append(Import(name, target, node.lineno, module_level))
    return out


def upward(found: list[Import], plugins: set[str]) -> list[str]:
    """The imports from kpt-core into a plugin package, as ``module:line -> target``."""
    return [f"{i.source}:{i.line} -> {i.target}" for i in found
            if i.source.split(".")[0] == CORE and i.target.split(".")[0] in plugins]


def circles(found: list[Import], known: dict[str, Path]) -> list[list[str]]:
    """The circles among the modules of one top-level package through module-level imports: each
    strongly connected set of more than one module (Tarjan's algorithm), sorted."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    for i in found:
        if i.module_level and i.target in known and i.target != i.source \
                and i.target.split(".")[0] == i.source.split(".")[0]:
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


@functools.cache
def _ours() -> tuple[dict[str, Path], set[str], list[Import]]:
    """The modules of every package under ``packages/*/src``, the plugins' top-level names and
    every import statement (read once for the tests below)."""
    known = modules(sorted(PACKAGES.glob("*/src")))
    tops = {name.split(".")[0] for name in known}
    return known, tops - {CORE}, imports(known)


def test_the_graph_covers_every_package() -> None:
    known, plugins, found = _ours()
    assert CORE in known and "kpt.bench.measure" in known
    assert {"kpt_triton", "kpt_cuda", "kpt_conformance", "kpt_fpga_sim"} <= plugins
    assert any(i.source == "kpt.bench.command" and i.target == "kpt.bench.sweeps" for i in found)


def test_core_imports_no_plugin() -> None:
    _, plugins, found = _ours()
    assert upward(found, plugins) == []


def test_no_package_imports_itself_in_a_circle() -> None:
    known, _, found = _ours()
    assert circles(found, known) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules([tmp_path])


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    known = _tree(tmp_path, {
        "kpt/__init__.py": "",
        "kpt/a.py": "from . import b\nfrom .c import thing\n",
        "kpt/b.py": "import kpt.a\n",
        "kpt/c.py": "def f():\n    from kpt import a\n    import kpt_plug.x\n",
        "kpt/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kpt import e\n"
                    "try:\n    pass\nexcept ImportError:\n    from kpt_plug import y\n",
        "kpt/e.py": "from .d import z\n",
        "kpt_plug/__init__.py": "",
        "kpt_plug/x.py": "from kpt import a\n",
        "kpt_plug/y.py": "",
    })
    found = imports(known)
    # a <-> b at module level; c imports a only in a function, d imports e only for type checkers
    assert circles(found, known) == [["kpt.a", "kpt.b"]]
    assert upward(found, {"kpt_plug"}) == ["kpt.c:3 -> kpt_plug.x", "kpt.d:7 -> kpt_plug.y"]
