"""The conformance report: per kernel, pass/fail counts, worst error against tolerance, speed."""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from pathlib import Path
from typing import Any

import kpt

KINDS = ("present", "forward", "backward", "errors", "perf")


class Report:
    """A pytest plugin that collects the ``kpt`` property of every test and writes the report."""

    def __init__(self, profile: str, backend: kpt.Backend | None, directory: Path) -> None:
        self.profile = profile
        self.backend = backend
        self.directory = directory
        self.results: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report) -> None:
        props = dict(report.user_properties).get("kpt")
        if props is None or (report.when != "call" and not (report.when == "setup" and report.outcome != "passed")):
            return
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.outcome == "skipped" else report.outcome
        self.results.append({**props, "test": report.nodeid.split("conformance/", 1)[-1], "outcome": outcome,
                             "message": str(report.longrepr.reprcrash.message)
                             if outcome == "failed" and hasattr(report.longrepr, "reprcrash") else ""})

    def summary(self) -> dict[str, dict[str, Any]]:
        table: dict[str, dict[str, Any]] = defaultdict(lambda: {k: [0, 0] for k in KINDS} | {"worst": 0.0})
        for r in self.results:
            row = table[r["kernel"]]
            if r["outcome"] != "skipped":
                row[r["kind"]][1] += 1
                row[r["kind"]][0] += r["outcome"] in ("passed", "xfailed")
            if "worst" in r and r["outcome"] == "passed":
                row["worst"] = max(row["worst"], r["worst"])
            for key in ("speedup_eager", "ceiling_fraction"):
                if key in r:
                    row[f"{r.get('mode', '')} {key}".strip()] = r[key]
        return {k: table[k] for k in kpt.SPECS if k in table}

    def pytest_sessionfinish(self, session) -> None:
        if not self.results:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        env = self.backend.environment() if self.backend else {}
        env |= {"python": platform.python_version(), "machine": platform.machine()}
        data = {"profile": self.profile, "environment": env, "summary": self.summary(), "results": self.results}
        (self.directory / "conformance.json").write_text(json.dumps(data, indent=1, default=str))
        (self.directory / "conformance.md").write_text(markdown(data))


def _cell(passed_total: list[int]) -> str:
    passed, total = passed_total
    if total == 0:
        return "–"
    return f"{passed}/{total}" if passed == total else f"**{passed}/{total}**"


def markdown(data: dict[str, Any]) -> str:
    """One table: kernel | present | forward | backward | errors | worst err/tol | speed."""
    env = ", ".join(f"{k} {v}" for k, v in data["environment"].items())
    lines = [f"### Conformance: `{data['profile']}`", "", f"Environment: {env}.", "",
             "| kernel | present | forward | backward | bad inputs | worst err / tol | perf |",
             "|---|---|---|---|---|---|---|"]
    for kernel, row in data["summary"].items():
        perf = "; ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in row.items()
                         if isinstance(v, float) and k != "worst") or "–"
        lines.append(f"| {kernel} | {_cell(row['present'])} | {_cell(row['forward'])} | {_cell(row['backward'])} "
                     f"| {_cell(row['errors'])} | {row['worst']:.2f} | {perf} |")
    failed = [r for r in data["results"] if r["outcome"] == "failed"]
    lines += ["", f"{len(failed)} failed of {len(data['results'])} recorded tests. Cells read passed/run "
              "(xfails declared in the backend's xfail file count as passed; bold: failures)."]
    return "\n".join(lines) + "\n"
