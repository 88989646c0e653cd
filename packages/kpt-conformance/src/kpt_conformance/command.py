"""``kpt check``: the conformance suite as a subcommand of ``kpt`` (the ``kpt.commands`` entry point).

    kpt check --backend mydevice [--device cuda:1] [--dtypes float32,bfloat16] [--kernels rms_norm,silu]
              [--seed N] [--report DIR] [--force] [--xfails FILE_OR_DIR] [-- PYTEST_ARGS...]

``python -m kpt check`` is the same command. A backend that cannot be checked here (unknown, not
installed, or unable to run on this machine) and every mistake in the options stop the run before
any test, with one line and a non-zero exit, and no report is written.
"""

from __future__ import annotations

import argparse

from kpt.cli import Command


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kpt check``'s options."""
    parser.add_argument("--backend", default=None, help="the backend to check (default: $KPT_BACKEND or reference)")
    parser.add_argument("--device", help="the device of the inputs, e.g. cuda:1 (default: the backend's)")
    parser.add_argument("--dtypes", type=_csv, default=[], help="comma-separated dtypes (default: the backend's)")
    parser.add_argument("--kernels", type=_csv, default=[], help="comma-separated kernels (default: all)")
    parser.add_argument("--seed", type=int, help="replay the random inputs of a run (its report names the seed)")
    parser.add_argument("--report", help="the report directory (default: reports/<profile>)")
    parser.add_argument("--force", action="store_true",
                        help="replace a report already in the report directory (without it, such a run stops "
                             "before any test, and the report is kept)")
    parser.add_argument("--xfails", help="expected failures: a file, or a directory holding <profile>.txt")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (it needs rich: pip install 'kpt-core[cli]')")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (-x, -k EXPR, -v)")


def run(args: argparse.Namespace) -> int:
    """Run the suite with the parsed options; pytest's exit status (4 for a mistake in them)."""
    from kpt_conformance import check

    return check(args.backend, device=args.device, dtypes=args.dtypes, kernels=args.kernels, seed=args.seed,
                 report=args.report, force=args.force, xfails=args.xfails, pytest_args=args.pytest_args,
                 progress=args.progress)


COMMAND = Command(
    help="run the conformance suite on an installed backend",
    description="Run the conformance suite on an installed backend and write conformance.json and .md "
                "(an existing report is kept unless --force is given); exits non-zero when a kernel fails or "
                "is missing. Arguments after -- go to pytest. `python -m kpt check` is the same command.",
    add_arguments=add_arguments, run=run)
