"""The kernel family modules of kpt-mps, one per ``shaders/<family>.metal``."""

from __future__ import annotations

from . import activations, layer_norm, rms_norm, softmax

FAMILIES = (rms_norm, layer_norm, softmax, activations)
