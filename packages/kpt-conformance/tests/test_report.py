"""The report's per-kernel summary: status, worst error ratio over every case, failing cases, speed."""

from __future__ import annotations

import math

import pytest

from kpt_conformance.report import markdown, summarize


def present(outcome: str = "passed", missing: tuple[str, ...] = ()) -> dict:
    return {"kind": "present", "missing": list(missing), "outcome": outcome, "message": "",
            "test": "test_contract.py::test_kernel_present[k]"}


def numerics(outcome: str, worst: float | None, case: str = "llm", description: str = "") -> dict:
    r = {"kind": "forward", "case": case, "description": description, "dtype": "float32", "outcome": outcome,
         "message": "y: relative error norm" if outcome == "failed" else "", "test": f"test_forward[k-{case}]"}
    return r if worst is None else {**r, "worst": worst}


def speed(outcome: str, message: str = "") -> dict:
    return {"kind": "perf", "mode": "fwd", "outcome": outcome, "message": message, "test": "test_speed[k-fwd]"}


@pytest.mark.parametrize("results, status", [
    ([present(), numerics("passed", 0.5)], "pass"),
    ([present(), numerics("passed", 0.5), numerics("failed", 7e4, "tiny")], "fail"),
    ([present("failed", ("backward",)), numerics("passed", 0.5)], "missing"),
    ([present("failed", ("backward",)), numerics("failed", 3.0)], "fail"),
    ([present(), numerics("xfailed", 2.0)], "xfail"),
    ([present("failed")], "fail"),  # the backend could not be loaded at all
])
def test_status(results: list[dict], status: str) -> None:
    assert summarize(results)["status"] == status


def test_worst_error_ratio_counts_failing_cases() -> None:
    row = summarize([present(), numerics("passed", 0.2), numerics("failed", 7e4, "tiny", "inputs scaled by 1e-4")])
    assert row["worst_error_ratio"] == 7e4 and (row["passed"], row["failed"]) == (2, 1)
    assert row["failing"] == [{"test": "test_forward[k-tiny]", "kind": "forward", "case": "tiny",
                               "description": "inputs scaled by 1e-4", "dtype": "float32", "error_ratio": 7e4,
                               "message": "y: relative error norm"}]


def test_a_case_that_raised_is_a_failing_case_without_a_ratio() -> None:
    row = summarize([present(), numerics("failed", None, "zero_cols")])
    assert row["status"] == "fail" and row["failing"][0]["error_ratio"] is None


def test_speed_without_a_bar_is_not_checked() -> None:
    row = summarize([present(), speed("skipped", "backend 'x' declares no speed bar for k")])
    assert row["speed"] == "not checked: backend 'x' declares no speed bar for k"
    assert summarize([present(), speed("passed")])["speed"] == "pass"
    assert summarize([present(), speed("passed"), speed("failed")])["speed"] == "fail"


def test_markdown_names_failing_cases_and_missing_bodies() -> None:
    kernels = {"rms_norm": summarize([present(), numerics("failed", math.inf, "tiny", "inputs scaled by 1e-4")]),
               "silu": summarize([present("failed", ("backward",)), numerics("passed", 0.1)])}
    data = {"backend": "acme", "profile": "acme", "versions": {"kpt": "0.1.0", "triton": None}, "device": "cpu",
            "seed": 42, "replay": "kpt check --backend acme --kernels rms_norm,silu --seed 42", "environment": {},
            "kernels": kernels}
    text = markdown(data)
    assert "| rms_norm | **fail** | 1 | 1 | 0 | NaN/inf |" in text
    assert "| silu | **missing (backward)** | 1 | 1 | 0 | 0.1 |" in text
    assert "- rms_norm (tiny: inputs scaled by 1e-4, float32, forward): y: relative error norm" in text
    assert "`kpt check --backend acme --kernels rms_norm,silu --seed 42` replays them" in text
