"""The kpt conformance suite: one set of tests, generated from the contract, that judges any backend.

    kpt check --backend mydevice [--device cuda:1] [--dtypes float32,bfloat16] [--kernels rms_norm]
              [--seed N] [--report DIR] [--xfails FILE_OR_DIR] [-- PYTEST_ARGS...]

`check` runs the suite (``kpt_conformance/suite``) through pytest with the suite's plugin
(`kpt_conformance.plugin`), from any directory, on any installed backend, and writes
``conformance.json`` and ``conformance.md`` (`kpt_conformance.report`). Its exit status is
pytest's: 0 when every selected kernel is present and passes, non-zero when one fails or is
missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__version__ = "0.1.0"

SUITE = Path(__file__).parent / "suite"
"""The test modules; their pytest ids (``test_numerics.py::test_forward[...]``) are what xfail files name."""


def check(backend: str, *, device: str | None = None, dtypes: Sequence[str] = (), kernels: Sequence[str] = (),
          seed: int | None = None, report: str | None = None, xfails: str | None = None,
          pytest_args: Sequence[str] = (), plugins: Sequence[object] = ()) -> int:
    """Run the conformance suite on ``backend``; returns the exit status (0: every kernel passed).

    ``device`` overrides where the inputs go (default: the backend's `kpt.Backend.device`);
    ``dtypes`` and ``kernels`` narrow the run (default: every dtype of the backend, every kernel
    of the contract); ``seed`` replays a run's random inputs (default: fresh, printed and saved
    in the report); ``report`` is the report directory (default ``reports/<profile>``);
    ``xfails`` an xfail file, or a directory holding ``<profile>.txt``; ``pytest_args`` go to
    pytest as they are (``-x``, ``-k rms_norm``, ``-v``); ``plugins``: pytest plugin objects
    (``kpt check``'s progress bar, `kpt_conformance.progress`).
    """
    import pytest

    args = [str(SUITE), "-c", str(SUITE / "pytest.ini"), "--rootdir", str(SUITE),
            "-p", "kpt_conformance.plugin", "--kpt-backend", backend]
    options = {"--kpt-device": device, "--kpt-dtypes": ",".join(dtypes), "--kpt-kernels": ",".join(kernels),
               "--kpt-seed": seed, "--kpt-report": report, "--kpt-xfails": xfails}
    for option, value in options.items():
        if value not in (None, ""):
            args += [option, str(value)]
    return int(pytest.main([*args, *pytest_args], plugins=list(plugins)))
