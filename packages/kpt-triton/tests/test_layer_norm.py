from __future__ import annotations

import pytest
import torch

from conftest import check_kernel, seeded
from kpt.spec import randn, strided
from kpt_triton import layer_norm as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

SHAPES = {"odd": (3, 17), "single": (1, 1), "rows3d": (2, 5, 33), "zero_rows": (0, 8), "zero_cols": (4, 0)}


def _args(g, dtype, shape, *, layout=lambda t: t, params=(True, True), param_dtype=None, offset=0.0):
    x = layout((randn(g, *shape, dtype=torch.float64) + offset).to(dtype))
    pd = param_dtype or dtype
    w = randn(g, shape[-1], dtype=pd) + 1.0 if params[0] else None
    b = randn(g, shape[-1], dtype=pd) if params[1] else None
    return {"x": x, "weight": w, "bias": b, "eps": 1e-5}


def _check(args, dtype, **tuning):
    def fwd(*a):
        return k.layer_norm_fwd(*a, **tuning)

    def bwd(*a):
        return k.layer_norm_bwd(*a, **tuning, programs_per_sm=1)

    check_kernel("layer_norm", fwd, bwd, args, dtype, compare_saved=("mean", "rstd"))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_shapes(dtype, shape):
    g = seeded(shape)
    _check(_args(g, dtype, shape), dtype)


@pytest.mark.parametrize("params", [(True, False), (False, True), (False, False)], ids=["w", "b", "none"])
def test_optional_params(dtype, params):
    _check(_args(torch.Generator().manual_seed(3), dtype, (5, 40), params=params), dtype)


def test_fp32_params_strided(dtype):
    g = torch.Generator().manual_seed(4)
    _check(_args(g, dtype, (6, 48), layout=strided, param_dtype=torch.float32), dtype)


@pytest.mark.parametrize("block", [16, 64], ids=["chunked", "whole"])
def test_large_mean(dtype, block):
    # |mean| ≫ std: a one-pass E[x²] − E[x]² variance would lose every digit; chunked rows take
    # the pairwise-merge path, several rows per program
    g = torch.Generator().manual_seed(5)
    _check(_args(g, dtype, (7, 45), offset=100.0), dtype, max_block=block, tile_elems=64)
