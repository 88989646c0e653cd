"""The kernel contract: one `KernelSpec` per kernel, one module per kernel family.

``SPECS`` maps every kernel name of the contract to its spec, in the contract's order (that of
the kernel reference, docs/reference/kernels.md).
"""

from __future__ import annotations

from ..spec import KernelSpec
from . import activations, attention, cross_entropy, fp8, layer_norm, linear, moe, rms_norm, rope, softmax

FAMILIES = (rms_norm, layer_norm, softmax, activations, rope, attention, linear, cross_entropy, moe, fp8)

SPECS: dict[str, KernelSpec] = {spec.name: spec for family in FAMILIES for spec in family.SPECS}
