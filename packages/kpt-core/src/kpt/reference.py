"""The reference backend: the contract's own PyTorch math, on any torch device.

It runs every kernel exactly as its spec defines it (in float64 it is the conformance oracle),
is embedded in kpt-core, and is what `kpt.get_backend` returns when no faster backend can run. It plugs in through the
same hook as every other backend.
"""

from __future__ import annotations

import torch

from .backend import Backend
from .hookspecs import hookimpl
from .kernels import SPECS
from .ops import Kernel


class ReferenceBackend(Backend):
    name = "reference"
    vendor = "kpt"
    device_type = "cpu"
    priority = 0
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

    def kernels(self) -> dict[str, Kernel]:
        return {name: Kernel(spec.forward, spec.backward) for name, spec in SPECS.items()}


@hookimpl
def kpt_backends() -> list[Backend]:
    return [ReferenceBackend()]
