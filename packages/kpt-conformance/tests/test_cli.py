"""`kpt check`: the command's options reach `kpt_conformance.check` unchanged."""

from __future__ import annotations

import re
import sys

import pytest

import kpt_conformance
from kpt import cli


def test_check_passes_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(kpt_conformance, "check", lambda *a, **kw: calls.append((a, kw)) or 3)
    status = cli.main(["check", "--backend", "acme", "--device", "cuda:1", "--dtypes", "float32,bfloat16",
                       "--kernels", "rms_norm", "--seed", "7", "--report", "out", "--xfails", "x.txt",
                       "--no-progress", "--", "-x"])
    assert status == 3
    assert calls == [(("acme",), {"device": "cuda:1", "dtypes": ["float32", "bfloat16"], "kernels": ["rms_norm"],
                                  "seed": 7, "report": "out", "force": False, "xfails": "x.txt",
                                  "pytest_args": ["-x"], "progress": False})]


def test_check_draws_a_progress_bar_over_every_test(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "--backend", "reference", "--kernels", "silu", "--dtypes", "float32",
                     "--report", str(tmp_path / "r"), "--", "-k", "contract"]) == 0
    out = capsys.readouterr().out
    ran = int(re.search(r"(\d+) passed", out)[1])
    assert f"kpt check {'━' * 10}" in out and f"{ran}/{ran}" in out
    assert f"report in {tmp_path / 'r'}" in out


def test_check_without_a_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("kpt: error: the following arguments are required: COMMAND (see kpt --help)")


def test_unknown_kernel_is_refused_before_any_test(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert kpt_conformance.check("reference", kernels=["rms_nrom"], report=str(tmp_path / "r")) == 4  # usage error
    assert not (tmp_path / "r").exists()


def test_without_rich_there_is_no_progress_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from kpt_conformance import progress

    monkeypatch.setitem(sys.modules, "rich.progress", None)
    assert progress.progress_plugins() == ((), ())
