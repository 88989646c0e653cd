"""The ``kpt`` command. Each subcommand parses its options and calls one library function.

    kpt info                        # versions, backends (usable here or why not), kernels
    kpt fpga-report compare linear --shape 8192,8192,8192 --device u280 --reuse 1,2,4   # the FPGA simulator's
    kpt fpga-report estimate model.pt --input-shape 1,16                                # cost reports
    kpt check --backend mydevice [--device cuda:1] [--dtypes float32,bfloat16] [--kernels rms_norm,silu]
              [--seed N] [--report DIR] [--xfails FILE_OR_DIR] [-- PYTEST_ARGS...]
    kpt bench --backend cuda [--kernels rms_norm,softmax] [--sweep perf|models|attention|linear|all] [--plot]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _check(args: argparse.Namespace) -> int:
    try:
        from kpt_conformance import check
    except ImportError:
        sys.exit("kpt check needs the conformance suite: pip install kpt-conformance")
    from kpt_conformance.progress import progress_plugins

    return check(args.backend, device=args.device, dtypes=args.dtypes, kernels=args.kernels, seed=args.seed,
                 report=args.report, xfails=args.xfails, pytest_args=args.pytest_args,
                 plugins=progress_plugins() if args.progress else ())


def _info(args: argparse.Namespace) -> int:
    from .overview import info
    from .registry import list_backends

    try:  # the optional extra kpt-core[cli]: a rich table; the aligned text table without it
        import rich.console
        import rich.table
    except ImportError:
        print(info())
        return 0
    header, *rows = list_backends().rows()
    table = rich.table.Table(*header, title="kpt backends")
    for row in rows:
        table.add_row(*row)
    console = rich.console.Console(width=160)  # the reasons are long: wrap them at a wide table's width
    with console.capture() as captured:
        console.print(table)
    print(info(backends=captured.get().rstrip()))
    return 0


def _fpga_report(args: argparse.Namespace) -> int:
    try:
        from kpt_fpga_sim.__main__ import main as fpga_main
    except ImportError:
        sys.exit("kpt fpga-report needs the FPGA simulator: pip install kpt-fpga-sim")
    return fpga_main([*args.args, *args.extra])


def _bench(args: argparse.Namespace) -> int:
    from .benchmark import run

    return run(args)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    from .benchmark import add_arguments

    bench = commands.add_parser(
        "bench", help="time the kernels against torch eager, torch.compile and the libraries (needs a GPU)",
        description="Time a backend's kernels on a sweep of shapes against torch eager, torch.compile and "
                    "the libraries present, and write bench.json and bench.md (with --plot, roofline.png). "
                    "Needs a GPU; --list shows a sweep's shapes anywhere.")
    add_arguments(bench)
    bench.set_defaults(run=_bench)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kpt", description="kpt: one kernel API for many accelerators")
    commands = p.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help="run the conformance suite on an installed backend",
        description="Run the conformance suite on an installed backend and write conformance.json and "
                    ".md; exits non-zero when a kernel fails or is missing. Arguments after -- go to pytest.")
    check.add_argument("--backend", default=os.environ.get("KPT_BACKEND", "reference"),
                       help="the backend to check (default: $KPT_BACKEND or reference)")
    check.add_argument("--device", help="the device of the inputs, e.g. cuda:1 (default: the backend's)")
    check.add_argument("--dtypes", type=_csv, default=[], help="comma-separated dtypes (default: the backend's)")
    check.add_argument("--kernels", type=_csv, default=[], help="comma-separated kernels (default: all)")
    check.add_argument("--seed", type=int, help="replay the random inputs of a run (its report names the seed)")
    check.add_argument("--report", help="the report directory (default: reports/<profile>)")
    check.add_argument("--xfails", help="expected failures: a file, or a directory holding <profile>.txt")
    check.add_argument("--no-progress", dest="progress", action="store_false",
                       help="no progress bar (it needs rich: pip install 'kpt-core[cli]')")
    check.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest (-x, -k EXPR, -v)")
    check.set_defaults(run=_check)
    commands.add_parser(
        "info", help="show versions, the installed backends and the kernels",
        description="Show the versions, every installed backend (whether it can run here, or why not), "
                    "the backend kpt.get_backend() picks here, and the kernels with their parameters.",
    ).set_defaults(run=_info)
    fpga = commands.add_parser(
        "fpga-report", add_help=False,
        help="the FPGA simulator's cost reports: compare (a kernel's directives), estimate (a network), calibrate",
        description="kpt-fpga-sim's command (cycles, II, resources, fit, roofline); every argument goes to "
                    "`python -m kpt_fpga_sim` (kpt fpga-report --help lists its subcommands).")
    fpga.add_argument("args", nargs="*")
    fpga.set_defaults(run=_fpga_report)
    _add_bench(commands)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    # fpga-report hands its options (--help included) to the simulator's command
    args, extra = p.parse_known_args(argv)
    if extra and args.command != "fpga-report":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args.run(args)
