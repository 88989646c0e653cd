"""Static tools see the kernel methods: mypy passes a user's first script (``typecheck/user_script.py``)
and flags a misspelled kernel and a wrongly typed argument; kpt-core itself passes mypy with the
settings of its pyproject.toml (``[tool.mypy]``), as every package that ships ``py.typed`` should."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

USER_SCRIPT = Path(__file__).resolve().parent / "typecheck" / "user_script.py"
CORE = Path(__file__).resolve().parents[1] / "packages" / "kpt-core"


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


def test_kpt_core_type_checks(cache: str) -> None:
    out, err, status = api.run([str(CORE / "src" / "kpt"), "--config-file", str(CORE / "pyproject.toml"),
                                "--cache-dir", cache])
    assert status == 0, out + err
