"""`kpt check` on the example backend, run as a vendor runs it, and its report.

Each run is the installed ``kpt`` command in an empty temporary directory: the suite comes from
the installed kpt-conformance, nothing from a kpt checkout. The backend has one wrong kernel
(rms_norm: eps after the square root) and one missing body (silu's backward); every other kernel
must pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kpt

KPT = Path(sys.executable).with_name("kpt")  # the console script of this environment
WRONG, MISSING = "rms_norm", "silu"


def kpt_check(directory: Path, *options: str) -> tuple[int, dict[str, Any]]:
    """Run ``kpt check --backend example`` in the empty ``directory``; its exit status and report."""
    directory.mkdir()
    done = subprocess.run([str(KPT), "check", "--backend", "example", "--report", "report", *options, "--", "-q"],
                          cwd=directory, capture_output=True, text=True)
    report = directory / "report" / "conformance.json"
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, json.loads(report.read_text())


def ratios(report: dict[str, Any], kernel: str) -> dict[str, float]:
    return {r["test"]: r["worst"] for r in report["results"] if r["kernel"] == kernel and "worst" in r}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    return kpt_check(tmp_path_factory.mktemp("check") / "full")


def test_exit_status_says_a_kernel_failed_or_is_missing(full_run) -> None:
    status, _ = full_run
    assert status == 1


def test_report_identifies_the_run(full_run) -> None:
    _, report = full_run
    assert report["schema_version"] == 2 and report["backend"] == "example" and report["device"] == "cpu"
    assert report["versions"]["kpt"] == kpt.__version__ and report["timestamp"].endswith("+00:00")
    assert report["versions"]["backend"] == "0.1.0" and report["versions"]["torch"]
    assert isinstance(report["seed"], int)


def test_wrong_kernel_fails_with_its_error_over_tolerance(full_run) -> None:
    _, report = full_run
    row = report["kernels"][WRONG]
    assert row["status"] == "fail" and row["failed"] > 0
    assert row["worst_error_ratio"] > 1
    # the failing cases are named with what they probe
    assert any(f["case"] == "tiny" and "inputs scaled by 0.0001" in f["description"] for f in row["failing"])


def test_missing_backward_is_one_missing_result(full_run) -> None:
    _, report = full_run
    row = report["kernels"][MISSING]
    assert row["status"] == "missing" and row["missing"] == ["backward"]
    assert row["failed"] == 1 and row["failing"] == []  # its presence test, nothing else
    assert row["passed"] > 0  # its forward is tested as usual
    assert not any("test_backward" in r["test"] for r in report["results"] if r["kernel"] == MISSING)


def test_every_other_kernel_passes(full_run) -> None:
    _, report = full_run
    others = {k: row for k, row in report["kernels"].items() if k not in (WRONG, MISSING)}
    assert len(others) == 18
    for kernel, row in others.items():
        assert row["status"] == "pass" and 0 <= row["worst_error_ratio"] <= 1, (kernel, report["seed"], row)


def test_no_speed_bar_is_reported_as_not_checked(full_run) -> None:
    _, report = full_run
    assert all(row["speed"].startswith("not checked") for row in report["kernels"].values())


def test_seed_replays_the_run(full_run, tmp_path: Path) -> None:
    _, report = full_run
    seed = report["seed"]
    _, replay = kpt_check(tmp_path / "replay", "--seed", str(seed), "--kernels", WRONG)
    assert replay["seed"] == seed and list(replay["kernels"]) == [WRONG]
    assert ratios(replay, WRONG) == ratios(report, WRONG)
    _, other = kpt_check(tmp_path / "other", "--seed", str(seed + 1), "--kernels", WRONG)
    assert ratios(other, WRONG) != ratios(report, WRONG)  # the seed is what the inputs come from
