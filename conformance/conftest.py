"""The kpt conformance suite: one set of tests that judges any backend.

    pytest conformance --kpt-backend cuda

Tests are generated from the contract (``kpt.SPECS``): a presence test per kernel, forward and
backward numerics per kernel x case x dtype, every documented bad input, and performance against
torch eager and torch.compile on the backend's device. Known gaps are data, not code: the strict
xfail file ``conformance/xfails/<profile>.txt`` (one test id or glob per line, ``# reason``
required) marks tests expected to fail; a listed test that passes fails the run. At the end a JSON
and Markdown report is written under ``--kpt-report`` (default ``reports/<profile>/``).
"""

from __future__ import annotations

import fnmatch
import os
import random
import zlib
from pathlib import Path

import pytest

import kpt
from report import Report

HERE = Path(__file__).parent


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kpt")
    group.addoption("--kpt-backend", default=os.environ.get("KPT_BACKEND", "reference"),
                    help="backend under test (default: $KPT_BACKEND or reference)")
    group.addoption("--kpt-xfails", default=None,
                    help="xfail file (default: conformance/xfails/<profile>.txt if it exists)")
    group.addoption("--kpt-report", default=None, help="report directory (default: reports/<profile>)")
    group.addoption("--kpt-seed", type=int, default=None, help="replay a run's random inputs (default: fresh)")


def _load_backend(config: pytest.Config) -> tuple[kpt.Backend | None, str]:
    """The backend under test, or None with the registry's reason when it cannot be used."""
    name = config.getoption("--kpt-backend")
    registry = kpt.registry.registry()
    found = registry.find(name)
    if found is None:
        info = registry.infos.get(name)
        if info is not None:
            return None, f"backend {name!r} {info.reason}: {info.error}"
        return None, f"backend {name!r} is not installed; registered: {', '.join(sorted(registry.infos))}"
    info = registry.infos[name]
    return found, "" if info.available and name in registry.backends else info.reason or str(info.error)


def pytest_configure(config: pytest.Config) -> None:
    backend, why = _load_backend(config)
    config.kpt_backend = backend
    config.kpt_unusable = why
    profile = backend.conformance_profile if backend else config.getoption("--kpt-backend")
    config.kpt_profile = profile
    report_dir = config.getoption("--kpt-report") or Path("reports") / profile
    seed = config.getoption("--kpt-seed")
    config.kpt_base_seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    config.kpt_seed = lambda test_id: (config.kpt_base_seed + zlib.crc32(test_id.encode())) % 2**31
    config.kpt_report = Report(profile, backend, Path(report_dir))
    config.pluginmanager.register(config.kpt_report, "kpt-report")


def pytest_report_header(config: pytest.Config) -> list[str]:
    be = config.kpt_backend
    lines = [f"kpt backend: {config.getoption('--kpt-backend')} (profile {config.kpt_profile}), "
             f"inputs seed {config.kpt_base_seed} (replay with --kpt-seed {config.kpt_base_seed})"]
    if be is not None:
        lines.append("kpt environment: " + ", ".join(f"{k}={v}" for k, v in be.environment().items()))
    if config.kpt_unusable:
        lines.append(f"kpt backend unusable: {config.kpt_unusable}")
    return lines


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config) -> kpt.Backend:
    if pytestconfig.kpt_backend is None or pytestconfig.kpt_unusable:
        pytest.fail(f"backend cannot be tested: {pytestconfig.kpt_unusable}", pytrace=False)
    return pytestconfig.kpt_backend


def _xfails(config: pytest.Config) -> dict[str, str]:
    path = config.getoption("--kpt-xfails") or HERE / "xfails" / f"{config.kpt_profile}.txt"
    path = Path(path)
    if not path.exists():
        return {}
    entries = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pattern, _, reason = line.partition("#")
        if not reason.strip():
            raise pytest.UsageError(f"{path}:{n}: every xfail needs a reason after '#'")
        entries[pattern.strip()] = reason.strip()
    return entries


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = _xfails(config)
    for item in items:
        test_id = item.nodeid.split("conformance/", 1)[-1]
        for pattern, reason in entries.items():
            if fnmatch.fnmatchcase(test_id, pattern):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
                break
