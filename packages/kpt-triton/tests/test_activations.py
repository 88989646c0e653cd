from __future__ import annotations

import pytest
import torch

from conftest import check_kernel, seeded
from kpt.spec import randn, strided
from kpt_triton import activations as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

# (kernel, extra arguments): every activation and approximation
KERNELS = {
    "gelu": ("gelu", {"approximate": "none"}),
    "gelu_tanh": ("gelu", {"approximate": "tanh"}),
    "silu": ("silu", {}),
    "swiglu": ("swiglu", {}),
    "geglu": ("geglu", {"approximate": "tanh"}),
    "geglu_erf": ("geglu", {"approximate": "none"}),
}
LAYOUTS = {
    "contiguous": lambda t: t,
    "strided": strided,
    "transposed": lambda t: t.t(),
    "column_slice": lambda t: torch.cat([t, t], -1)[..., : t.shape[-1]],
}


def _run(kernel, extra, shape, dtype, *, layout=lambda t: t, scale=1.0, block=4096):
    g = seeded(kernel, shape, scale)
    gated = kernel in ("swiglu", "geglu")
    args = {"gate" if gated else "x": layout(randn(g, *shape, dtype=dtype, scale=scale))}
    if gated:
        args["up"] = layout(randn(g, *shape, dtype=dtype))
    args.update(extra)
    fwd, bwd = getattr(k, f"{kernel}_fwd"), getattr(k, f"{kernel}_bwd")
    check_kernel(kernel, lambda *a: fwd(*a, block=block), lambda *a: bwd(*a, block=block), args, dtype)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("shape", [(3, 17), (1, 1), (2, 3, 5), (0, 4), (4, 0)], ids=str)
def test_shapes(dtype, name, shape):
    _run(*KERNELS[name], shape, dtype)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(dtype, name, layout):
    # small blocks: several row and column tiles per tensor, partial tiles at both edges
    _run(*KERNELS[name], (9, 37), dtype, layout=LAYOUTS[layout], block=16)


@pytest.mark.parametrize("name", KERNELS)
def test_extreme(dtype, name):
    # |x| ≫ 88 overflows exp in float32: a naive sigmoid or tanh gives inf/inf = NaN
    gated = KERNELS[name][0] in ("swiglu", "geglu")
    _run(*KERNELS[name], (8, 64), dtype, scale=100.0 if gated else 1e4)
