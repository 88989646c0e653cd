"""The kernel family modules of kpt-mps, one per ``shaders/<family>.metal``."""

from __future__ import annotations

from kpt.kernels import family_modules

FAMILIES = family_modules("kpt_mps")
