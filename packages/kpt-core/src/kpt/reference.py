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

_MKL_VML_FUNCTIONS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10",
                      "log2", "sin", "sqrt", "tan", "tanh", "trunc")
"""The float unary ops torch computes on CPU through MKL's vector math library (VML)."""


def resolve_cpu_math() -> None:
    """Call each VML-backed op once, on one element, before any multithreaded use.

    oneMKL picks each VML function's implementation on its first call; when that first call runs
    on several intra-op threads at once, one thread can compute its whole chunk with the
    low-accuracy kernel (about half the mantissa bits, float32 and float64 alike), once per
    process (pytorch/pytorch#188792, oneMKL 2024.2). A one-element call runs on the calling thread
    alone and settles the choice, so the oracle and the CPU backends stay accurate.
    """
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in _MKL_VML_FUNCTIONS:
            getattr(torch, name)(x)


resolve_cpu_math()


class ReferenceBackend(Backend):
    name = "reference"
    vendor = "kpt"
    device_type = "cpu"
    priority = 0
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    checks_indices = True

    def kernels(self) -> dict[str, Kernel]:
        return {name: Kernel(spec.forward, spec.backward) for name, spec in SPECS.items()}


@hookimpl
def kpt_backends() -> list[Backend]:
    return [ReferenceBackend()]
