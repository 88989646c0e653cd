"""Portable Triton kernel bodies for the kpt contract, one module per kernel family.

Each module holds private ``@triton.jit`` kernels and the public launchers
``<kernel>_fwd`` / ``<kernel>_bwd`` that follow the body contract of ``kpt.kernels.<family>``.
Backends collect them with ``kpt.kernels_from`` and bind their tuning (keyword-only
arguments of the launchers).
"""

from __future__ import annotations

__version__ = "0.1.0"
