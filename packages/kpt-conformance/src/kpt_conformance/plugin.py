"""The pytest plugin of the conformance suite: which backend, which inputs, which tests, the report.

`kpt_conformance.check` (``kpt check``) loads it with ``-p kpt_conformance.plugin``. Tests are
generated from the contract (``kpt.SPECS``): a presence test per kernel, forward and backward
numerics per kernel x case x dtype, every documented bad input, and speed on the backend's device.

A backend is checked kernel by kernel: a kernel it lacks fails its presence test, naming the
missing forward or backward, and the tests that would call the missing body are deselected; every
other kernel is tested as usual. Known gaps are data, not code: a strict xfail file (one test id or
glob per line, ``# reason`` required) marks tests expected to fail; a listed test that passes
fails the run. The report goes to ``--kpt-report`` (default ``reports/<profile>/``).
"""

from __future__ import annotations

import fnmatch
import os
import random
import zlib
from pathlib import Path

import pytest
import torch

import kpt
from kpt_conformance.report import Report


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kpt")
    group.addoption("--kpt-backend", default=os.environ.get("KPT_BACKEND", "reference"),
                    help="backend under test (default: $KPT_BACKEND or reference)")
    group.addoption("--kpt-device", default=None, help="device of the inputs (default: the backend's)")
    group.addoption("--kpt-dtypes", default="", help="comma-separated dtypes (default: every dtype of the backend)")
    group.addoption("--kpt-kernels", default="", help="comma-separated kernels (default: every kernel)")
    group.addoption("--kpt-xfails", default=None,
                    help="xfail file, or a directory holding <profile>.txt (default: none)")
    group.addoption("--kpt-report", default=None, help="report directory (default: reports/<profile>)")
    group.addoption("--kpt-seed", type=int, default=None, help="replay a run's random inputs (default: fresh)")
    group.addoption("--kpt-fuzz-examples", type=int, default=25,
                    help="invalid calls hypothesis tries per kernel (default: 25)")
    group.addoption("--kpt-fuzz-valid-examples", type=int, default=3,
                    help="valid calls hypothesis checks against the oracle per kernel (default: 3)")


def _load_backend(name: str) -> tuple[kpt.Backend | None, str, dict[str, tuple[str, ...]]]:
    """The backend under test, why it cannot be tested ("" when it can) and the bodies it lacks.

    A backend the registry refused only for lacking kernels is tested: kernel by kernel."""
    registry = kpt.registry.registry()
    backend = registry.find(name)
    if backend is None:
        info = registry.infos.get(name)
        if info is not None:
            return None, f"backend {name!r} {info.reason}: {info.error}", {}
        return None, f"backend {name!r} is not installed; registered: {', '.join(sorted(registry.infos))}", {}
    if backend.contract_version != kpt.CONTRACT_VERSION:
        return backend, registry.infos[name].reason, {}
    try:
        missing = kpt.missing_kernels(backend.kernels())
        available, why = backend.is_available()
    except Exception as exc:  # the registry recorded it too; here it makes every test fail with it
        return backend, f"kernels() or is_available() raised {exc!r}", {}
    return backend, "" if available else why, missing


def _names(option: str, allowed: list[str], what: str) -> list[str]:
    names = [n.strip() for n in option.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise pytest.UsageError(f"unknown {what}: {', '.join(unknown)}; expected some of: {', '.join(allowed)}")
    return names


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--kpt-backend")
    backend, why, missing = _load_backend(name)
    config.kpt_backend = backend
    config.kpt_unusable = why
    config.kpt_missing = missing
    device = config.getoption("--kpt-device")
    config.kpt_device = torch.device(device) if device else backend.device() if backend else torch.device("cpu")
    dtypes = {str(d).removeprefix("torch."): d for d in (backend.dtypes if backend else kpt.FLOAT_DTYPES)}
    chosen = _names(config.getoption("--kpt-dtypes"), list(dtypes), f"dtypes for backend {name!r}")
    config.kpt_dtypes = tuple(dtypes[d] for d in chosen) or tuple(dtypes.values())
    config.kpt_kernels = _names(config.getoption("--kpt-kernels"), list(kpt.SPECS), "kernels") or list(kpt.SPECS)
    profile = backend.conformance_profile if backend else name
    config.kpt_profile = profile
    seed = config.getoption("--kpt-seed")
    config.kpt_base_seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    # each test draws from its own seed, so a run of some tests replays them as the whole run drew them
    config.kpt_seed = lambda test_id: (config.kpt_base_seed + zlib.crc32(test_id.encode())) % 2**31
    report_dir = Path(config.getoption("--kpt-report") or Path("reports") / profile)
    config.kpt_report = Report(name, profile, backend, config.kpt_device, config.kpt_base_seed, report_dir)
    config.pluginmanager.register(config.kpt_report, "kpt-report")


def _replay(config: pytest.Config) -> str:
    return f"inputs seed {config.kpt_base_seed} (replay with --seed {config.kpt_base_seed})"


def pytest_report_header(config: pytest.Config) -> list[str]:
    be = config.kpt_backend
    lines = [f"kpt backend: {config.getoption('--kpt-backend')} (profile {config.kpt_profile}) "
             f"on {config.kpt_device}, {_replay(config)}"]
    if be is not None:
        lines.append("kpt environment: " + ", ".join(f"{k}={v}" for k, v in be.environment().items()))
    if config.kpt_unusable:
        lines.append(f"kpt backend unusable: {config.kpt_unusable}")
    return lines


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    # the header is hidden under -q; the seed must survive any verbosity
    terminalreporter.write_line(f"kpt {config.getoption('--kpt-backend')}: {_replay(config)}; "
                                f"report in {config.kpt_report.directory}")


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config) -> kpt.Backend:
    if pytestconfig.kpt_backend is None or pytestconfig.kpt_unusable:
        pytest.fail(f"backend cannot be tested: {pytestconfig.kpt_unusable}", pytrace=False)
    if pytestconfig.kpt_device.type == "cuda" and pytestconfig.kpt_device.index is not None:
        torch.cuda.set_device(pytestconfig.kpt_device)  # kernels launch on the current device
    return pytestconfig.kpt_backend


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """Where the inputs go: ``--kpt-device``, else the backend's device."""
    return pytestconfig.kpt_device


def _xfails(config: pytest.Config) -> dict[str, str]:
    option = config.getoption("--kpt-xfails")
    if option is None:
        return {}
    path = Path(option)
    if path.is_dir():
        path = path / f"{config.kpt_profile}.txt"
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


def kernel_and_part(item: pytest.Item) -> tuple[str | None, str]:
    """The kernel a test checks and the body it calls ("forward" or "backward"); ``(None, "")``
    for a test of the whole backend. The presence test's part is ""."""
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    if "kernel" in params:
        return params["kernel"], ""
    if "spec" not in params:
        return None, ""
    backward = item.originalname == "test_backward" or params.get("mode") == "fwd+bwd"
    return params["spec"].name, "backward" if backward else "forward"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = _xfails(config)
    selected, deselected = [], []
    for item in items:
        kernel, part = kernel_and_part(item)
        # a test of a body the backend lacks would only repeat its presence test's failure
        if kernel is not None and (kernel not in config.kpt_kernels or part in config.kpt_missing.get(kernel, ())):
            deselected.append(item)
            continue
        selected.append(item)
        for pattern, reason in entries.items():
            if fnmatch.fnmatchcase(item.nodeid, pattern):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
                break
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
