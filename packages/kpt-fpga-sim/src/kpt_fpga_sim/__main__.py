"""``python -m kpt_fpga_sim``: the same command as ``kpt fpga-report`` (`kpt_fpga_sim.command`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kpt.cli import run

from .command import COMMAND


def main(argv: Sequence[str] | None = None) -> int:
    return run(COMMAND, argv, prog="python -m kpt_fpga_sim")


if __name__ == "__main__":
    sys.exit(main())
