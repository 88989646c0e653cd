"""The conformance report: ``conformance.json`` (schema below) and ``conformance.md``, per run.

``conformance.json``, schema version 2 (1 had no ``timestamp`` and no contract version)::

    {"schema_version": 2, "backend": name, "profile": ..., "versions": {"kpt": ..., "contract": int,
     "backend": ..., "torch": ..., "triton": ... or null, "python": ...}, "device": "cpu",
     "machine": "x86_64", "timestamp": "2026-11-25T18:00:00+00:00", "seed": int,
     "replay": "kpt check --backend name --kernels ... --seed int",
     "environment": {field: str, ...: the backend's facts, only the fields of ENVIRONMENT_FIELDS},
     "kernels": {name: {"status": "pass" | "fail" | "missing" | "xfail", "worst_error_ratio": float,
                        "passed": int, "failed": int, "xfailed": int, "missing": ["backward"],
                        "failing": [{"test", "kind", "case", "description", "dtype",
                                     "error_ratio", "message"}],
                        "speed": "pass" | "fail" | "not checked: <why>", "speed_numbers": {...}}},
     "results": [one entry per test]}

``worst_error_ratio`` is the largest error over tolerance of every numerics test of the kernel,
failing ones included (above 1 is a failure; a NaN result or an unwritten element is Infinity).
``status`` is ``fail`` when any test of the kernel failed, else ``missing`` when it lacks a forward
or backward body, else ``xfail`` when a test declared in the xfail file failed as expected, else
``pass``. Replaying ``seed`` (``kpt check --seed``) draws the same inputs; ``replay`` is the whole
command that does it, with the run's options.

The report is written only as ``conformance.json`` and ``conformance.md`` in the chosen
directory, and the backend's `kpt.Backend.environment` only through `environment`: named fields,
one-line strings, whatever else a plugin returns is left out.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import kpt
from kpt.overview import provenance

SCHEMA_VERSION = 2

FILES = ("conformance.json", "conformance.md")
"""What a report is: the only files it writes, in its directory."""

ENVIRONMENT_FIELDS = ("torch", "triton", "cuda", "hip", "xpu", "cupy", "driver", "device", "arch", "capability",
                      "sm_count", "compute_units", "sub_group_sizes", "machine", "fpga_sim")
"""The facts of `kpt.Backend.environment` a report records: versions and the device's description."""

_MAX_FIELD = 200


def environment(backend: kpt.Backend) -> dict[str, str]:
    """The backend's `kpt.Backend.environment` as reports record it: the fields named in
    `ENVIRONMENT_FIELDS` whose values are strings, each cut to one line of at most 200
    characters; any other field (an ``os.environ`` a plugin returns, say) is left out."""
    facts = backend.environment()
    return {k: v.splitlines()[0][:_MAX_FIELD] if v else v for k, v in facts.items()
            if k in ENVIRONMENT_FIELDS and isinstance(v, str)}


def _backend_version(backend: kpt.Backend) -> str | None:
    """The version of the distribution that installed the backend's module."""
    top = type(backend).__module__.partition(".")[0]
    distributions = metadata.packages_distributions().get(top, [])
    try:
        return metadata.version(distributions[0]) if distributions else None
    except metadata.PackageNotFoundError:
        return None


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).removeprefix("Failed: ")
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, "Skipped: why")
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr or "")


class Report:
    """A pytest plugin that collects the ``kpt`` property of every test and writes the report."""

    def __init__(self, name: str, profile: str, backend: kpt.Backend, device: torch.device, seed: int,
                 directory: Path, replay: str) -> None:
        self.name = name
        self.profile = profile
        self.backend = backend
        self.device = device
        self.seed = seed
        self.directory = directory
        self.replay = replay
        self.results: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report) -> None:
        props: dict[str, Any] = {}
        for key, value in report.user_properties:
            if key == "kpt":
                props |= value
        if not props or (report.when != "call" and not (report.when == "setup" and report.outcome != "passed")):
            return
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.outcome == "skipped" else report.outcome
        message = _message(report) if outcome in ("failed", "skipped") else ""
        self.results.append({**props, "test": report.nodeid, "outcome": outcome, "message": message})

    def kernels(self) -> dict[str, dict[str, Any]]:
        """The per-kernel summary of the recorded results, in the contract's order."""
        by_kernel: dict[str, list[dict[str, Any]]] = {}
        for r in self.results:
            by_kernel.setdefault(r["kernel"], []).append(r)
        return {k: summarize(by_kernel[k]) for k in kpt.SPECS if k in by_kernel}

    def data(self) -> dict[str, Any]:
        run = provenance(self.device)
        run["versions"]["backend"] = _backend_version(self.backend)
        return {"schema_version": SCHEMA_VERSION, "backend": self.name, "profile": self.profile, **run,
                "seed": self.seed, "replay": self.replay, "environment": environment(self.backend),
                "kernels": self.kernels(), "results": self.results}

    def pytest_sessionfinish(self, session) -> None:
        if not self.results:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        data = self.data()
        json_file, md_file = (self.directory / f for f in FILES)
        json_file.write_text(json.dumps(data, indent=1, default=str))
        md_file.write_text(markdown(data))


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One kernel's entry of the report from its tests' results (see the module docstring)."""
    outcomes = Counter(r["outcome"] for r in results)
    missing = [part for r in results if r["kind"] == "present" for part in r["missing"]]
    ratios = [r["worst"] for r in results if "worst" in r]
    failing = [{"test": r["test"], "kind": r["kind"], "case": r.get("case", ""),
                "description": r.get("description", ""), "dtype": r.get("dtype", ""),
                "error_ratio": r.get("worst"), "message": r["message"]}
               for r in results if r["outcome"] == "failed" and r["kind"] != "present"]
    # a kernel's presence test fails for what it lacks (status "missing"); any other failure is a fail
    failed = [r for r in results if r["outcome"] == "failed" and not (r["kind"] == "present" and r["missing"])]
    status = "fail" if failed else "missing" if missing else "xfail" if outcomes["xfailed"] else "pass"
    perf = [r for r in results if r["kind"] == "perf"]
    return {"status": status, "worst_error_ratio": max(ratios, default=0.0), "passed": outcomes["passed"],
            "failed": outcomes["failed"], "xfailed": outcomes["xfailed"], "missing": missing, "failing": failing,
            "speed": _speed(perf), "speed_numbers": {r["mode"]: r["numbers"] for r in perf if "numbers" in r}}


def _speed(perf: list[dict[str, Any]]) -> str:
    """``pass`` or ``fail`` when a speed test ran, else ``not checked`` with the reasons."""
    ran = [r for r in perf if r["outcome"] in ("passed", "failed")]
    if not ran:
        reasons = sorted({r["message"] for r in perf if r["message"]}) or ["no speed test selected"]
        return "not checked: " + "; ".join(reasons)
    return "fail" if any(r["outcome"] == "failed" for r in ran) else "pass"


def _ratio(value: float) -> str:
    return "NaN/inf" if not math.isfinite(value) else f"{value:.3g}"


def markdown(data: dict[str, Any]) -> str:
    """The kernel table, then every failing case with what it is and its message."""
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items() if v)
    env = ", ".join(f"{k} {v}" for k, v in data["environment"].items())
    lines = [f"### Conformance: `{data['backend']}` (profile `{data['profile']}`)", "",
             f"Versions: {versions}. Device: {data['device']}. Environment: {env}.", "",
             f"Inputs seed {data['seed']}: `{data['replay']}` replays them.",
             "", "| kernel | status | passed | failed | xfailed | worst err / tol | speed |",
             "|---|---|---|---|---|---|---|"]
    kernels = data["kernels"]
    for kernel, row in kernels.items():
        status = row["status"] + (f" ({', '.join(row['missing'])})" if row["missing"] else "")
        status = status if row["status"] == "pass" else f"**{status}**"
        lines.append(f"| {kernel} | {status} | {row['passed']} | {row['failed']} | {row['xfailed']} "
                     f"| {_ratio(row['worst_error_ratio'])} | {_speed_cell(row)} |")
    counts = Counter(row["status"] for row in kernels.values())
    lines += ["", ", ".join(f"{n} {status}" for status, n in counts.most_common()) + f" of {len(kernels)} kernels."]
    unchecked = [k for k, row in kernels.items() if row["speed"].startswith("not checked")]
    if unchecked:
        lines.append(f"Speed not checked for {len(unchecked)} of {len(kernels)} kernels (see the speed column).")
    failing = [(kernel, f) for kernel, row in kernels.items() for f in row["failing"]]
    if failing:
        lines += ["", "Failing cases:", ""]
        for kernel, f in failing:
            what = f"{f['case']}: {f['description']}" if f["description"] else f["case"]
            where = ", ".join(p for p in (what, f["dtype"], f["kind"]) if p)
            lines.append(f"- {kernel} ({where}): {f['message']}")
    return "\n".join(lines) + "\n"


def _speed_cell(row: dict[str, Any]) -> str:
    numbers = "; ".join(f"{mode}: " + ", ".join(f"{k.replace('_', ' ')} {v:.3g}" for k, v in nums.items())
                        for mode, nums in row["speed_numbers"].items())
    status = "not checked" if row["speed"].startswith("not checked") else row["speed"]
    return f"{status}{' (' + numbers + ')' if numbers else ''}"
