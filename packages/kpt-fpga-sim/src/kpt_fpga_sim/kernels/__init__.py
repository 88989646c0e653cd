"""Kernel bodies and designs, one module per kernel family (the family names of ``kpt.kernels``).

Each module defines, per kernel, ``<kernel>_fwd`` / ``<kernel>_bwd`` (the bodies core wraps into
custom ops) and ``<kernel>_design`` / ``<kernel>_bwd_design`` (the loop nests that compute them,
taking the current `kpt_fpga_sim.sim.Call` and the same arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kpt.kernels import family_modules

FAMILIES = family_modules(__name__)
"""This package's module of each kernel family of ``kpt.kernels``, named alike."""


def design_function(kernel: str, direction: str) -> Callable[..., Any]:
    """The design of ``kernel``'s forward or backward body."""
    attr = f"{kernel}_design" if direction == "forward" else f"{kernel}_bwd_design"
    for family in FAMILIES:
        fn = getattr(family, attr, None)
        if fn is not None:
            return fn
    raise KeyError(f"no design {attr} in the kpt_fpga_sim kernel modules")
