"""Static tools see the kernel methods: mypy passes a user's first script (``typecheck/user_script.py``)
and flags a misspelled kernel and a wrongly typed argument; every package that ships ``py.typed``
passes mypy with the repository's settings (``mypy.ini``, whose ``files`` name each such package)."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from mypy import api

USER_SCRIPT = Path(__file__).resolve().parent / "typecheck" / "user_script.py"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("mypy_cache"))


def mypy(path: Path, cache: str) -> tuple[str, int]:
    out, err, status = api.run([str(path), "--cache-dir", cache, "--no-error-summary"])
    return out + err, status


def test_user_script_type_checks(cache: str) -> None:
    out, status = mypy(USER_SCRIPT, cache)
    assert status == 0, out


def test_misspelled_kernel_and_wrong_argument_are_flagged(cache: str, tmp_path: Path) -> None:
    script = tmp_path / "typo.py"
    script.write_text(USER_SCRIPT.read_text().replace("be.rms_norm(x, w)", "be.rms_nrom(x, w)")
                      .replace("eps=1e-5", 'eps="small"'))
    out, status = mypy(script, cache)
    assert status == 1
    assert 'error: "Backend" has no attribute "rms_nrom"' in out
    assert 'Argument "eps" to "add_rms_norm" of "KernelMethods" has incompatible type "str"; expected "float"' in out


def test_mypy_ini_names_every_typed_package() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "mypy.ini")
    files = {f.strip() for f in config["mypy"]["files"].split(",") if f.strip()}
    typed = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("packages/*/src/*/py.typed")}
    assert files == typed


def test_every_typed_package_type_checks(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # mypy.ini's files are relative to the repository root
    out, err, status = api.run(["--config-file", "mypy.ini", "--cache-dir", cache])
    assert status == 0, out + err
