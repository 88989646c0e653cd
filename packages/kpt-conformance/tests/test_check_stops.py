"""`kpt check` stops before any test, with one line and no report, when the run cannot mean
anything: an unknown backend (by option or KPT_BACKEND), a bad device, kernel or xfail file, a
report already in the directory (without --force), a profile that is not a name. And what a run
records: the replay command with its options, only named environment fields."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kpt
import kpt_conformance
from kpt import cli
from kpt_conformance import report

CONTRACT_ONLY = ("--", "-k", "contract")  # the presence test: the quickest run that writes a report


def _kpt(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kpt", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return done, time.perf_counter() - started


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("args, env, words", [
    (("check", "--backend", "nope"), {}, "unknown kpt backend 'nope'"),
    (("check",), {"KPT_BACKEND": "nonsense"}, "unknown kpt backend 'nonsense'"),
    (("check", "--kernels", "nope"), {}, "unknown kernels: nope"),
    (("check", "--device", "u999"), {}, "--device 'u999' is not a torch device"),
    (("check", "--xfails", "missing.txt"), {}, "--xfails missing.txt: no such file"),
])
def test_a_mistake_stops_at_once_with_one_line(tmp_path: Path, args: tuple[str, ...], env: dict[str, str],
                                               words: str) -> None:
    done, seconds = _kpt(*args, cwd=tmp_path, env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    line = _one_line(done.stderr)
    assert words in line
    assert "collected" not in done.stdout and not (tmp_path / "reports").exists()  # no test ran, no report
    assert seconds < 60  # the whole suite took minutes; the limit leaves room for a loaded machine
    if "KPT_BACKEND" in env:
        assert "(named by KPT_BACKEND)" in line
    if "backend" in words:
        assert "pip install kpt-cuda" in line  # what to install


def test_an_unusable_backend_stops_with_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    reference = type(kpt.get_backend("reference"))
    monkeypatch.setattr(reference, "is_available", lambda self: (False, "the acme card is unplugged"))
    assert kpt_conformance.check("reference", report=str(tmp_path / "r")) == 4
    assert "backend 'reference' cannot run here: the acme card is unplugged" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("profile", ["../../x", "/tmp/kpt-x", "Ref", "-x", ""])
def test_a_profile_that_is_not_a_name_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], profile: str) -> None:
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setattr(type(kpt.get_backend("reference")), "conformance_profile", property(lambda self: profile))
    assert kpt_conformance.check("reference", kernels=["silu"], pytest_args=["-k", "contract"]) == 4
    assert f"names its conformance profile {profile!r}, which is not a name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]


def test_an_existing_report_is_kept_unless_force(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r"
    out.mkdir()
    (out / "conformance.md").write_text("last week's report\n")
    args = ["check", "--backend", "reference", "--kernels", "silu", "--report", str(out), "--no-progress"]
    assert cli.main([*args, *CONTRACT_ONLY]) == 4
    assert f"{out} already holds a report (conformance.md): keeping it" in capsys.readouterr().err
    assert (out / "conformance.md").read_text() == "last week's report\n" and not (out / "conformance.json").exists()
    assert cli.main([*args, "--force", *CONTRACT_ONLY]) == 0
    assert (out / "conformance.md").read_text().startswith("### Conformance: `reference`")


def test_the_replay_hint_keeps_the_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    xfails = tmp_path / "x.txt"
    xfails.write_text("# none\n")
    assert cli.main(["check", "--backend", "reference", "--kernels", "silu,rms_norm", "--dtypes", "float32",
                     "--xfails", str(xfails), "--seed", "11", "--report", "r", "--no-progress", *CONTRACT_ONLY]) == 0
    replay = (f"kpt check --backend reference --dtypes float32 --kernels silu,rms_norm --xfails {xfails} "
              "--seed 11 -- -k contract")
    assert f"(replay: {replay})" in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "conformance.json").read_text())["replay"] == replay
    assert f"`{replay}` replays them" in (tmp_path / "r" / "conformance.md").read_text()


def test_the_progress_bar_has_its_own_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "--backend", "reference", "--kernels", "silu,gelu", "--dtypes", "float32",
                     "--report", "r", "--", "-k", "contract or test_errors"]) == 0
    lines = capsys.readouterr().out.splitlines()
    bars = [line for line in lines if "━" in line]
    assert bars and all(re.fullmatch(r"kpt check ━+ (\d+)/\1 \d+:\d\d:\d\d", line) for line in bars), bars
    assert not [line for line in lines if re.search(r"\.\.|\[\s*\d+%\]", line)]  # no dots, no percentages


def test_a_verbose_pytest_draws_no_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "--backend", "reference", "--kernels", "silu", "--report", "r", "--", "-v",
                     "-k", "contract"]) == 0
    out = capsys.readouterr().out
    assert "test_contract.py ." in out and "━" not in out  # pytest's own progress, quiet undone by -v


class _Leaky:
    def environment(self) -> dict[str, object]:
        return {"torch": "2.13.0", "device": "Acme NPU\nsecond line", "arch": "x" * 500, "cuda": 12,
                "HOME": "/home/me", "AWS_SECRET_ACCESS_KEY": "hunter2", "environ": {"PATH": "/bin"}}


def test_environment_keeps_only_named_string_fields() -> None:
    assert report.environment(_Leaky()) == {"torch": "2.13.0", "device": "Acme NPU", "arch": "x" * 200}


def test_a_report_records_no_free_form_environment(tmp_path: Path) -> None:
    data = report.Report("acme", "acme", _Leaky(), torch.device("cpu"), 1, tmp_path, "kpt check").data()
    assert data["environment"] == {"torch": "2.13.0", "device": "Acme NPU", "arch": "x" * 200}
    assert "hunter2" not in json.dumps(data)
