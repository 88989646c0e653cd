"""The ``kpt`` command's dispatch: subcommands from ``kpt.commands`` entry points, one-line errors,
``python -m kpt``, ``kpt --version``. The plugins here are throwaway distributions (a ``.dist-info``
and a module in a temporary directory on the path)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kpt
from kpt import cli

HELLO = '''
import argparse
from kpt.cli import Command, UsageError

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="world")

def run(args: argparse.Namespace) -> int:
    if args.name == "nobody":
        raise UsageError("--name nobody: say hello to someone")
    print(f"hello {args.name}")
    return 0

COMMAND = Command(help="say hello", description="Say hello.", add_arguments=add_arguments, run=run)
'''


def _distribution(root: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kpt.commands]\n{lines}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Installs acme-hello (``kpt hello``, and an entry point trying to take ``kpt info``) and
    acme-broken (``kpt broken``, whose module raises at import)."""
    _distribution(tmp_path, "acme-hello", {"hello": "acme_hello:COMMAND", "info": "acme_hello:COMMAND"},
                  {"acme_hello": HELLO})
    _distribution(tmp_path, "acme-broken", {"broken": "acme_broken:COMMAND", "exits": "acme_exits:COMMAND"},
                  {"acme_broken": "raise ImportError('acme_broken needs libacme.so')",
                   "acme_exits": "raise SystemExit('acme_exits quits')"})
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _kpt(*args: str, path: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if path is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(path), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kpt", *args], capture_output=True, text=True, timeout=120,
                          env=environ)


def test_a_plugin_adds_a_subcommand(plugins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["hello", "--name", "kpt"]) == 0
    assert capsys.readouterr().out == "hello kpt\n"
    assert cli.main(["hello", "--name", "nobody"]) == 2
    assert capsys.readouterr().err == "kpt hello: error: --name nobody: say hello to someone\n"


def test_help_lists_the_installed_subcommands_and_the_broken_ones(plugins: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all(f"    {name} " in out for name in ("info", "bench", "hello"))
    assert "kpt broken cannot run: acme-broken 1.0 failed to load it (acme_broken:COMMAND): ImportError: " in out
    assert "kpt exits cannot run: acme-broken 1.0 failed to load it (acme_exits:COMMAND): SystemExit: " in out
    assert "`python -m kpt` is the same command" in out


@pytest.mark.parametrize("name, error", [("broken", "ImportError: acme_broken needs libacme.so"),
                                         ("exits", "SystemExit: acme_exits quits")])
def test_a_broken_subcommand_is_one_line(plugins: Path, capsys: pytest.CaptureFixture[str], name: str,
                                         error: str) -> None:
    assert cli.main([name]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kpt: error: kpt {name} cannot run: acme-broken 1.0 failed to load it")
    assert err.count("\n") == 1
    assert err.rstrip().endswith(error)


def test_a_broken_subcommand_leaves_kpt_info_and_the_builtins(plugins: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KPT_BACKEND", "reference")
    for module in ("acme_hello", "acme_broken", "acme_exits"):  # imported by the tests before
        monkeypatch.delitem(sys.modules, module, raising=False)
    assert cli.main(["info"]) == 0  # acme-hello's "info" entry point does not take it over
    assert "kpt.get_backend() here: reference" in capsys.readouterr().out
    assert "acme_broken" not in sys.modules and "acme_hello" not in sys.modules  # only what runs is imported


def test_end_to_end_errors_are_one_line_without_traceback(plugins: Path) -> None:
    for args, words in [(["broken"], "kpt broken cannot run"), (["nope"], "unknown command 'nope'"),
                        (["hello", "--nope"], "kpt: error: unrecognized arguments: --nope")]:
        done = _kpt(*args, path=plugins)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and words in done.stderr, done.stderr


def test_an_uninstalled_subcommand_names_its_package(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "installed", dict)
    for name, package in cli.PROVIDERS.items():
        assert cli.main([name, "--help"]) == 2
        assert capsys.readouterr().err == (f"kpt: error: kpt {name} comes with {package}, which is not installed: "
                                           f"pip install {package}\n")


def test_two_distributions_claiming_a_name_are_both_named(plugins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _distribution(plugins, "acme-other", {"hello": "acme_other:COMMAND"}, {"acme_other": HELLO})
    assert cli.main(["hello"]) == 1
    assert "kpt hello cannot run: claimed by acme-hello 1.0 and acme-other 1.0" in capsys.readouterr().err


def test_kpt_info_imports_no_subcommand_plugin() -> None:
    code = ("import sys; from kpt.cli import main; main(['info']); "
            "print(sorted(m for m in sys.modules if m.startswith('kpt_conformance')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_cli_module_imports_no_plugin_package() -> None:
    tree = ast.parse(Path(cli.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported and not {m for m in imported if m.startswith("kpt_")}


def test_python_m_kpt_is_the_kpt_command() -> None:
    done = _kpt("info", env={"KPT_BACKEND": "reference"})
    assert done.returncode == 0, done.stderr
    assert "kpt.get_backend() here: reference" in done.stdout


def test_version_names_core_and_the_installed_plugins(plugins: Path) -> None:
    done = _kpt("--version", path=plugins)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"kpt-core {kpt.__version__} (kernel contract v{kpt.CONTRACT_VERSION})"
    assert "acme-hello 1.0" in lines and "acme-broken 1.0" in lines
