from __future__ import annotations

import pytest
import torch

from conftest import check_kernel, seeded
from kpt.spec import randn, strided
from kpt_triton import rms_norm as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

SHAPES = {"odd": (3, 17), "single": (1, 1), "rows3d": (2, 5, 33), "zero_rows": (0, 8), "zero_cols": (4, 0)}


def _args(g, dtype, shape, *, residual, layout=lambda t: t, weight="same", eps=1e-6):
    x = layout(randn(g, *shape, dtype=dtype))
    args = {"x": x}
    if residual:
        args["residual"] = layout(randn(g, *shape, dtype=dtype))
    w = None if weight is None else randn(g, shape[-1], dtype=dtype if weight == "same" else weight) + 1.0
    return {**args, "weight": w, "eps": eps}


@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_shapes(dtype, shape, residual):
    g = seeded(shape, residual)
    name = "add_rms_norm" if residual else "rms_norm"
    fwd, bwd = getattr(k, f"{name}_fwd"), getattr(k, f"{name}_bwd")
    # With one column dx = g·eps/(x²+eps)^1.5 cancels catastrophically in float32 unless eps is large.
    args = _args(g, dtype, shape, residual=residual, eps=0.5 if shape[-1] == 1 else 1e-6)
    check_kernel(name, fwd, bwd, args, dtype, compare_saved=("rstd",))


@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("variant", ["strided", "fp32_weight", "no_weight", "chunked", "one_program"])
def test_variants(dtype, residual, variant):
    g = torch.Generator().manual_seed(7)
    name = "add_rms_norm" if residual else "rms_norm"
    fwd, bwd = getattr(k, f"{name}_fwd"), getattr(k, f"{name}_bwd")
    kw = {}
    if variant == "strided":
        args = _args(g, dtype, (5, 40), residual=residual, layout=strided)
    elif variant == "fp32_weight":
        args = _args(g, dtype, (5, 40), residual=residual, weight=torch.float32)
    elif variant == "no_weight":
        args = _args(g, dtype, (5, 40), residual=residual, weight=None)
    elif variant == "chunked":
        # rows wider than one chunk take the multi-pass path; several rows per program
        args = _args(g, dtype, (7, 37), residual=residual, layout=strided)
        kw = {"max_block": 16, "tile_elems": 32}
    else:
        # seven one-row tiles in one program, which writes the weight's gradient itself
        args = _args(g, dtype, (7, 40), residual=residual)
        kw = {"tile_elems": 64}
    bkw = {**kw, "programs_per_sm": 1} if variant != "one_program" else {**kw, "one_program_tiles": 8}

    def fwd_t(*a):
        return fwd(*a, **kw)

    def bwd_t(*a):
        return bwd(*a, **bkw)

    check_kernel(name, fwd_t, bwd_t, args, dtype, compare_saved=("rstd",))
