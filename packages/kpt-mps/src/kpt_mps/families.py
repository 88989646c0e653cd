"""The kernel family modules of kpt-mps, one per ``shaders/<family>.metal``."""

from __future__ import annotations

from . import activations, attention, cross_entropy, fp8, layer_norm, linear, moe, rms_norm, rope, softmax

FAMILIES = (rms_norm, layer_norm, softmax, activations, rope, attention, linear, cross_entropy, moe, fp8)
