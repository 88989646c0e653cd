"""The kernel family modules of kpt-mps, one per ``shaders/<family>.metal``."""

from __future__ import annotations

from . import rms_norm

FAMILIES = (rms_norm,)
