"""The ``kpt`` command: core's own subcommands, and those the installed kpt packages add.

    kpt info                        # versions, backends (usable here or why not), kernels
    kpt bench --backend cuda [--kernels rms_norm,softmax] [--sweep perf|models|attention|linear|all] [--plot]
    kpt check --backend mydevice ...                     # from kpt-conformance: the conformance suite
    kpt fpga-report compare linear --shape 64,64,64      # from kpt-fpga-sim: the simulator's cost reports
    kpt --version                   # kpt-core's version and the installed kpt packages'

``python -m kpt`` is the same command and always works: on some machines ``kpt`` on the PATH is
another program (Google's Kubernetes tool of that name, from google-cloud-sdk).

Core imports no plugin. A package adds a subcommand through an entry point of the
``kpt.commands`` group, named as the subcommand and pointing at a `Command`::

    [project.entry-points."kpt.commands"]
    check = "kpt_conformance.command:COMMAND"

A subcommand's module is imported only when that subcommand runs, or when ``kpt --help`` lists
them all. One that fails to import gives one line naming its package; the other subcommands,
``kpt info`` among them, are unaffected. Core's own subcommands (`BUILTIN`) cannot be taken over
by a plugin. Every mistake on the command line is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import NoReturn

from .errors import BackendError, KernelInputError, KernelNotSupportedError

COMMAND_GROUP = "kpt.commands"

PROVIDERS = {"check": "kpt-conformance", "fpga-report": "kpt-fpga-sim"}
"""The subcommands of the project's own packages, to name the package to install when one is missing."""

_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True)
class Command:
    """One subcommand of ``kpt``: what a ``kpt.commands`` entry point points at."""

    help: str
    """One line for ``kpt --help``."""
    description: str
    """The paragraph at the top of ``kpt NAME --help``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's options (and its own subcommands, if any) to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it on the parsed options; returns the exit status. Raise `UsageError` for a mistake
    in the options: it is printed as one line."""


class UsageError(Exception):
    """A mistake on the command line (a missing file, a bad shape, an unknown name): printed as
    ``<command>: error: <message>`` on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a mistake is one line (saying where the usage is), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench.command import add_arguments

    add_arguments(parser)


def _bench(args: argparse.Namespace) -> int:
    from .bench.command import run

    return run(args)


BUILTIN = {
    "info": Command(
        help="show versions, the installed backends and the kernels",
        description="Show the versions, every installed backend (whether it can run here, or why not), "
                    "the backend kpt.get_backend() picks here, and the kernels with their parameters.",
        add_arguments=lambda parser: None, run=_info),
    "bench": Command(
        help="time the kernels against torch eager, torch.compile and the libraries (needs a GPU)",
        description="Time a backend's kernels on a sweep of shapes against torch eager, torch.compile and "
                    "the libraries present, and write bench.json and bench.md (with --plot, roofline.png). "
                    "Needs a GPU; --list shows a sweep's shapes anywhere.",
        add_arguments=_bench_arguments, run=_bench),
}
"""kpt-core's own subcommands."""


def _distribution(ep: metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else ep.value


def installed() -> dict[str, list[metadata.EntryPoint]]:
    """The installed ``kpt.commands`` entry points by subcommand name (several when more than one
    distribution claims a name), without those named as a `BUILTIN` or not named
    ``[a-z0-9][a-z0-9-]*``."""
    found: dict[str, dict[str, metadata.EntryPoint]] = {}
    for ep in metadata.entry_points(group=COMMAND_GROUP):
        if ep.name not in BUILTIN and _NAME.fullmatch(ep.name):
            found.setdefault(ep.name, {}).setdefault(ep.value, ep)  # one distribution seen twice is one
    return {name: list(eps.values()) for name, eps in sorted(found.items())}


def load(name: str, eps: Sequence[metadata.EntryPoint]) -> Command | str:
    """The `Command` of subcommand ``name``, or why it cannot run (one line)."""
    if len(eps) > 1:
        return f"claimed by {' and '.join(sorted(_distribution(ep) for ep in eps))}: uninstall one of them"
    ep = eps[0]
    try:
        command = ep.load()
    except (Exception, SystemExit) as exc:  # a broken plugin must not take the command down
        return f"{_distribution(ep)} failed to load it ({ep.value}): {type(exc).__name__}: {exc}"
    if not isinstance(command, Command):
        return f"{_distribution(ep)}'s entry point {ep.value} is a {type(command).__name__}, not a kpt.cli.Command"
    return command


def versions() -> str:
    """What ``kpt --version`` prints: kpt-core's version (and its kernel contract's), then every
    installed distribution that adds a backend or a subcommand (read from the installed metadata:
    nothing is imported)."""
    from . import __version__
    from .backend import CONTRACT_VERSION

    plugins = {_distribution(ep) for group in ("kpt.backends", COMMAND_GROUP)
               for ep in metadata.entry_points(group=group) if ep.dist is not None}
    return "\n".join([f"kpt-core {__version__} (kernel contract v{CONTRACT_VERSION})", *sorted(plugins)])


def _description(command: Command) -> str:
    """A description in lines (a docstring with examples) as written; one line wrapped."""
    return command.description if "\n" in command.description else textwrap.fill(command.description, 100)


def _add(commands: argparse._SubParsersAction, name: str, command: Command) -> None:
    sub = commands.add_parser(name, help=command.help, description=_description(command),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(sub)
    sub.set_defaults(run=command.run)


def parser(plugins: dict[str, Command | str] | None = None) -> argparse.ArgumentParser:
    """The ``kpt`` parser with core's subcommands and ``plugins`` (default: every installed one);
    a plugin that cannot run is listed below the subcommands with the reason."""
    if plugins is None:
        plugins = {name: load(name, eps) for name, eps in installed().items()}
    broken = {name: why for name, why in plugins.items() if isinstance(why, str)}
    epilog = ["`python -m kpt` is the same command (use it where `kpt` on the PATH is another program)."]
    epilog += [f"kpt {name} cannot run: {why}" for name, why in broken.items()]
    missing = [f"kpt {name} (pip install {package})" for name, package in PROVIDERS.items() if name not in plugins]
    if missing:
        epilog.append(f"Not installed: {', '.join(missing)}.")
    p = _Parser(prog="kpt", description="kpt: one kernel API for many accelerators", epilog="\n".join(epilog),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=versions(),
                   help="show kpt-core's version and the installed kpt packages', then exit")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    loaded = {name: command for name, command in plugins.items() if isinstance(command, Command)}
    for name, command in {**BUILTIN, **loaded}.items():
        _add(commands, name, command)
    return p


def execute(p: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse ``argv`` with ``p`` and run the chosen command; a `UsageError` or a kpt error (a bad
    input, an unusable backend) is printed as one line."""
    args = p.parse_args(argv)
    prog = f"{p.prog} {args.command}" if getattr(args, "command", None) else p.prog
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (KernelInputError, KernelNotSupportedError, BackendError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


def run(command: Command, argv: Sequence[str] | None = None, *, prog: str) -> int:
    """Run one `Command` on its own, as ``prog`` (what a package's ``python -m`` entry calls)."""
    p = _Parser(prog=prog, description=_description(command), formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(p)
    p.set_defaults(run=command.run)
    return execute(p, sys.argv[1:] if argv is None else argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``kpt`` (and ``python -m kpt``): load only the subcommand asked for (all of them for
    ``kpt --help``), then parse and run it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in argv if not a.startswith("-")), None)
    entry_points = installed()
    if name is None:
        plugins = {} if "--version" in argv else {n: load(n, eps) for n, eps in entry_points.items()}
    elif name in BUILTIN:
        plugins = {}
    elif name in entry_points:
        command = load(name, entry_points[name])
        if isinstance(command, str):
            print(f"kpt: error: kpt {name} cannot run: {command}", file=sys.stderr)
            return 1
        plugins = {name: command}
    elif name in PROVIDERS:
        print(f"kpt: error: kpt {name} comes with {PROVIDERS[name]}, which is not installed: "
              f"pip install {PROVIDERS[name]}", file=sys.stderr)
        return 2
    else:
        print(f"kpt: error: unknown command {name!r}; the commands here: "
              f"{', '.join([*BUILTIN, *entry_points])} (kpt --help describes them)", file=sys.stderr)
        return 2
    return execute(parser(plugins), argv)
