"""The pytest plugin of the conformance suite: which backend, which inputs, which tests, the report.

`kpt_conformance.check` (``kpt check``) loads it with ``-p kpt_conformance.plugin``. Tests are
generated from the contract (``kpt.SPECS``): a presence test per kernel, forward and backward
numerics per kernel x case x dtype, every documented bad input, and speed on the backend's device.

A backend is checked kernel by kernel: a kernel it lacks fails its presence test, naming the
missing forward or backward, and the tests that would call the missing body are deselected; every
other kernel is tested as usual. Known gaps are data, not code: a strict xfail file (one test id or
glob per line, ``# reason`` required) marks tests expected to fail; a listed test that passes
fails the run. The report goes to ``--kpt-report`` (default ``reports/<profile>/``); a report
already there is kept unless ``--kpt-force`` is given.

Anything that makes a run meaningless stops it in `pytest_configure`, before any test, with one
line (`pytest.UsageError`, exit status 4) and no report: a backend that is unknown, failed to
load or cannot run here, a profile that is not a name, an unknown kernel or dtype, a bad device,
a missing xfail file, an existing report.
"""

from __future__ import annotations

import fnmatch
import os
import random
import re
import shlex
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kpt
from kpt_conformance.report import FILES, Report, environment

PROFILE = re.compile(r"[a-z0-9][a-z0-9-]*")
"""What a `kpt.Backend.conformance_profile` may be: it names a directory and a file."""


@dataclass(frozen=True)
class Run:
    """What `pytest_configure` settles for a run, before any test: the fixtures, the hooks and the
    suite's tests read it with `run_of`."""

    name: str
    """The backend's name as given (``--kpt-backend``, ``$KPT_BACKEND`` or ``reference``)."""
    backend: kpt.Backend
    missing: dict[str, tuple[str, ...]]
    """Kernel -> the bodies the backend lacks ("forward", "backward")."""
    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    kernels: list[str]
    profile: str
    xfails: dict[str, str]
    """Test id or glob -> reason, from the xfail file."""
    base_seed: int
    report: Report

    def seed(self, test_id: str) -> int:
        """The seed of one test: each test draws from its own, so a run of some tests replays
        them as the whole run drew them."""
        return (self.base_seed + zlib.crc32(test_id.encode())) % 2**31


RUN = pytest.StashKey[Run]()


def run_of(config: pytest.Config) -> Run:
    """The run `pytest_configure` settled (kept in pytest's typed ``config.stash``)."""
    return config.stash[RUN]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kpt")
    group.addoption("--kpt-backend", default=None, help="backend under test (default: $KPT_BACKEND or reference)")
    group.addoption("--kpt-device", default=None, help="device of the inputs (default: the backend's)")
    group.addoption("--kpt-dtypes", default="", help="comma-separated dtypes (default: every dtype of the backend)")
    group.addoption("--kpt-kernels", default="", help="comma-separated kernels (default: every kernel)")
    group.addoption("--kpt-xfails", default=None,
                    help="xfail file, or a directory holding <profile>.txt (default: none)")
    group.addoption("--kpt-report", default=None, help="report directory (default: reports/<profile>)")
    group.addoption("--kpt-force", action="store_true", help="replace a report already in the report directory")
    group.addoption("--kpt-seed", type=int, default=None, help="replay a run's random inputs (default: fresh)")
    group.addoption("--kpt-fuzz-examples", type=int, default=25,
                    help="invalid calls hypothesis tries per kernel (default: 25)")
    group.addoption("--kpt-fuzz-valid-examples", type=int, default=3,
                    help="valid calls hypothesis checks against the oracle per kernel (default: 3)")


def _backend_name(config: pytest.Config) -> tuple[str, str]:
    """The backend under test, and where its name came from (for the messages)."""
    name = config.getoption("--kpt-backend")
    if name:
        return name, ""
    if os.environ.get("KPT_BACKEND"):
        return os.environ["KPT_BACKEND"], " (named by KPT_BACKEND)"
    return "reference", ""


def _load_backend(name: str, source: str = "") -> tuple[kpt.Backend, dict[str, tuple[str, ...]]]:
    """The backend under test and the bodies it lacks; `pytest.UsageError` when it cannot be
    tested here. A backend the registry refused only for lacking kernels is tested: kernel by
    kernel."""
    backend = kpt.registry.registry().find(name)
    if backend is None or backend.contract_version != kpt.CONTRACT_VERSION:
        try:
            kpt.get_backend(name)
        except kpt.BackendError as exc:  # says why (and, for kpt's own backends, what to install)
            hint = "" if "pip install" in str(exc) else (
                ". Each backend comes in its own package: pip install kpt-cuda, kpt-rocm, kpt-xpu, kpt-mps or "
                "kpt-fpga-sim, or a vendor's")
            raise pytest.UsageError(f"{exc}{source}{hint}") from None
        raise pytest.UsageError(f"backend {name!r}{source} cannot be checked: the registry holds no such backend")
    try:
        missing = kpt.missing_kernels(backend.kernels())
        available, why = backend.is_available()
    except Exception as exc:
        raise pytest.UsageError(f"backend {name!r}{source}: kernels() or is_available() raised {exc!r}") from exc
    if not available:
        raise pytest.UsageError(f"backend {name!r}{source} cannot run here: {why}")
    return backend, missing


def _names(option: str, allowed: list[str], what: str) -> list[str]:
    names = [n.strip() for n in option.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise pytest.UsageError(f"unknown {what}: {', '.join(unknown)}; expected some of: {', '.join(allowed)}")
    return names


def _device(config: pytest.Config, backend: kpt.Backend) -> torch.device:
    option = config.getoption("--kpt-device")
    if not option:
        return backend.device()
    try:
        return torch.device(option)
    except RuntimeError as exc:
        raise pytest.UsageError(f"--device {option!r} is not a torch device (cpu, cuda:1, xpu, mps): {exc}") from exc


def replay_command(config: pytest.Config, name: str, base_seed: int) -> str:
    """The ``kpt check`` line that runs these tests again on the same inputs: the options given
    (kernels, dtypes, device, xfails, pytest's ``-k`` and ``-m``), with the run's seed."""
    words = ["kpt", "check", "--backend", name]
    for option, flag in (("--kpt-device", "--device"), ("--kpt-dtypes", "--dtypes"),
                         ("--kpt-kernels", "--kernels"), ("--kpt-xfails", "--xfails")):
        if config.getoption(option):
            words += [flag, str(config.getoption(option))]
    words += ["--seed", str(base_seed)]
    selection = [w for flag, value in (("-k", config.option.keyword), ("-m", config.option.markexpr)) if value
                 for w in (flag, value)]
    return shlex.join([*words, *(["--", *selection] if selection else [])])


def pytest_configure(config: pytest.Config) -> None:
    name, source = _backend_name(config)
    backend, missing = _load_backend(name, source)
    device = _device(config, backend)
    dtypes = {str(d).removeprefix("torch."): d for d in backend.dtypes}
    chosen = _names(config.getoption("--kpt-dtypes"), list(dtypes), f"dtypes for backend {name!r}")
    kernels = _names(config.getoption("--kpt-kernels"), list(kpt.SPECS), "kernels") or list(kpt.SPECS)
    profile = backend.conformance_profile
    if not isinstance(profile, str) or not PROFILE.fullmatch(profile):
        raise pytest.UsageError(f"backend {name!r} names its conformance profile {profile!r}, which is not a "
                                "name ([a-z0-9][a-z0-9-]*): it names the report directory and the xfail file")
    xfails = _xfails(config.getoption("--kpt-xfails"), profile)
    report_dir = Path(config.getoption("--kpt-report") or Path("reports") / profile)
    existing = [f for f in FILES if (report_dir / f).exists()]
    if existing and not config.getoption("--kpt-force"):
        raise pytest.UsageError(f"{report_dir} already holds a report ({', '.join(existing)}): keeping it. "
                                "Give --force to replace it, or --report another directory")
    seed = config.getoption("--kpt-seed")
    base_seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    report = Report(name, profile, backend, device, base_seed, report_dir,
                    replay=replay_command(config, name, base_seed))
    config.stash[RUN] = Run(name, backend, missing, device, tuple(dtypes[d] for d in chosen) or tuple(dtypes.values()),
                            kernels, profile, xfails, base_seed, report)
    config.pluginmanager.register(report, "kpt-report")


def _replay(config: pytest.Config) -> str:
    run = run_of(config)
    return f"inputs seed {run.base_seed} (replay: {run.report.replay})"


def pytest_report_header(config: pytest.Config) -> list[str]:
    run = run_of(config)
    env = ", ".join(f"{k}={v}" for k, v in environment(run.backend).items())
    return [f"kpt backend: {run.name} (profile {run.profile}) on {run.device}, "
            f"{_replay(config)}", f"kpt environment: {env}"]


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    # the header is hidden under -q; the seed must survive any verbosity
    run = run_of(config)
    terminalreporter.write_line(f"kpt {run.name}: {_replay(config)}; report in {run.report.directory}")


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config) -> kpt.Backend:
    run = run_of(pytestconfig)
    if run.device.type == "cuda" and run.device.index is not None:
        torch.cuda.set_device(run.device)  # kernels launch on the current device
    return run.backend


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """Where the inputs go: ``--kpt-device``, else the backend's device."""
    return run_of(pytestconfig).device


def _xfails(option: str | None, profile: str) -> dict[str, str]:
    """The xfail entries of ``--kpt-xfails`` (a file, or a directory holding ``<profile>.txt``):
    test id or glob -> reason."""
    if option is None:
        return {}
    path = Path(option)
    if path.is_dir():
        path = path / f"{profile}.txt"
        if not path.exists():
            return {}
    elif not path.is_file():
        raise pytest.UsageError(f"--xfails {option}: no such file or directory")
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
    test = item.originalname if isinstance(item, pytest.Function) else item.name
    backward = test == "test_backward" or params.get("mode") == "fwd+bwd"
    return params["spec"].name, "backward" if backward else "forward"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run = run_of(config)
    selected, deselected = [], []
    for item in items:
        kernel, part = kernel_and_part(item)
        # a test of a body the backend lacks would only repeat its presence test's failure
        if kernel is not None and (kernel not in run.kernels or part in run.missing.get(kernel, ())):
            deselected.append(item)
            continue
        selected.append(item)
        for pattern, reason in run.xfails.items():
            if fnmatch.fnmatchcase(item.nodeid, pattern):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
                break
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
