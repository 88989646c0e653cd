"""The kernel contract: one `KernelSpec` per kernel, one module per kernel family.

``SPECS`` maps every kernel name of the contract to its spec, in the order of KERNELS.md.
"""

from __future__ import annotations

from ..spec import KernelSpec
from . import rms_norm

FAMILIES = (rms_norm,)

SPECS: dict[str, KernelSpec] = {spec.name: spec for family in FAMILIES for spec in family.SPECS}
