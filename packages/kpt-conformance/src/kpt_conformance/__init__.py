"""The kpt conformance suite: one set of tests, generated from the contract, that judges any backend.

    kpt check --backend mydevice [--device cuda:1] [--dtypes float32,bfloat16] [--kernels rms_norm]
              [--seed N] [--report DIR] [--force] [--xfails FILE_OR_DIR] [-- PYTEST_ARGS...]

`check` runs the suite (``kpt_conformance/suite``) through pytest with the suite's plugin
(`kpt_conformance.plugin`), from any directory, on any installed backend, and writes
``conformance.json`` and ``conformance.md`` (`kpt_conformance.report`). Its exit status is
pytest's: 0 when every selected kernel is present and passes, non-zero when one fails or is
missing. The ``kpt check`` subcommand is `kpt_conformance.command`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__version__ = "0.1.0"

SUITE = Path(__file__).parent / "suite"
"""The test modules; their pytest ids (``test_numerics.py::test_forward[...]``) are what xfail files name."""


def check(backend: str | None = None, *, device: str | None = None, dtypes: Sequence[str] = (),
          kernels: Sequence[str] = (), seed: int | None = None, report: str | None = None, force: bool = False,
          xfails: str | None = None, pytest_args: Sequence[str] = (), progress: bool = False,
          plugins: Sequence[object] = ()) -> int:
    """Run the conformance suite on ``backend``; returns the exit status (0: every kernel passed).

    ``backend`` defaults to ``$KPT_BACKEND``, else ``reference``. ``device`` overrides where the
    inputs go (default: the backend's `kpt.Backend.device`); ``dtypes`` and ``kernels`` narrow
    the run (default: every dtype of the backend, every kernel of the contract); ``seed``
    replays a run's random inputs (default: fresh, printed and saved in the report); ``report``
    is the report directory (default ``reports/<profile>``), where a report already there is
    kept unless ``force``; ``xfails`` an xfail file, or a directory holding ``<profile>.txt``;
    ``pytest_args`` go to pytest as they are (``-x``, ``-k rms_norm``, ``-v``); ``progress``
    draws a progress bar in place of pytest's dots (with rich, `kpt_conformance.progress`);
    ``plugins``: more pytest plugin objects.

    A backend that cannot be checked here and every mistake in the options stop the run before
    any test (exit status 4, one line on stderr, no report).
    """
    import pytest

    from .progress import progress_plugins

    args = [str(SUITE), "-c", str(SUITE / "pytest.ini"), "--rootdir", str(SUITE), "-p", "kpt_conformance.plugin"]
    options = {"--kpt-backend": backend, "--kpt-device": device, "--kpt-dtypes": ",".join(dtypes),
               "--kpt-kernels": ",".join(kernels), "--kpt-seed": seed, "--kpt-report": report,
               "--kpt-xfails": xfails}
    for option, value in options.items():
        if value not in (None, ""):
            args += [option, str(value)]
    if force:
        args.append("--kpt-force")
    bars, quiet = progress_plugins() if progress else ((), ())
    return int(pytest.main([*args, *quiet, *pytest_args], plugins=[*bars, *plugins]))
