from __future__ import annotations

import pytest
import torch

from conftest import assert_nan_rows_stay, check_kernel, device, seeded
from kpt.spec import identity, randn, strided
from kpt.testing import to_device
from kpt_triton import linear as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
# small tiles: several row and column tiles, K steps and ragged edges in every case
TILES = {"tiles16": ({"block_m": 16, "block_n": 16, "block_k": 16, "group_m": 2}, {"block": (4, 16)}),
         "default": ({}, {})}


def _args(g, dtype, x_shape, n, *, bias=None, activation=None, scale=1.0, layout=identity):
    """``bias``: None, "same" (x's dtype) or a dtype."""
    kd = x_shape[-1]
    b = None if bias is None else randn(g, n, dtype=dtype if bias == "same" else bias)
    return {"x": layout(randn(g, *x_shape, dtype=dtype, scale=scale)),
            "weight": layout(randn(g, n, kd, dtype=dtype, scale=max(kd, 1) ** -0.5)), "bias": b,
            "activation": activation}


def _bodies(tiles):
    def fwd(*a):
        return k.linear_fwd(*a, **tiles[0])

    def bwd(*a):
        return k.linear_bwd(*a, **tiles[1])

    return fwd, bwd


@pytest.mark.parametrize("tiles", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_activations(dtype, activation, tiles):
    g = seeded(activation, str(dtype))
    args = _args(g, dtype, (2, 17, 40), 33, bias="same", activation=activation)
    check_kernel("linear", *_bodies(tiles), args, dtype, compare_saved=("pre",) if activation else ())


SHAPES = {  # x shape, N, bias, activation
    "no_bias": ((17, 24), 20, None, "gelu_tanh"),
    # one element: no activation, whose derivative near its zero would make one rounding of the
    # saved pre-activation an unbounded relative error (activations are test_activations' job)
    "single": ((1, 1), 1, "same", None),
    "vector_x": ((100,), 17, None, "silu"),
    "odd": ((17, 3), 33, "same", "silu"),
    "long_k": ((3, 300), 17, "same", "relu"),
    "zero_rows": ((0, 64), 32, "same", "gelu"),
    "zero_k": ((4, 0), 8, "same", "relu"),
    "zero_n": ((4, 64), 0, None, "silu"),
    "zero_k_plain": ((4, 0), 8, "same", None),
}


@pytest.mark.parametrize("tiles", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_shapes(dtype, shape, tiles):
    x_shape, n, bias, activation = shape
    g = seeded(shape)
    args = _args(g, dtype, x_shape, n, bias=bias, activation=activation)
    check_kernel("linear", *_bodies(tiles), args, dtype)


VARIANTS = ["fp32_bias", "fp32_bias_plain", "strided", "transposed", "huge_silu", "huge_gelu_tanh", "tiny"]


@pytest.mark.parametrize("tiles", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants(dtype, variant, tiles):
    g = torch.Generator().manual_seed(41)
    if variant == "fp32_bias":
        # mixed precision training: a float32 bias with activations of any dtype
        args = _args(g, dtype, (20, 48), 40, bias=torch.float32, activation="gelu_tanh")
    elif variant == "fp32_bias_plain":
        args = _args(g, dtype, (20, 48), 40, bias=torch.float32)
    elif variant == "strided":
        args = _args(g, dtype, (33, 40), 24, bias="same", activation="gelu", layout=strided)
    elif variant == "transposed":
        # a weight that is the transpose of a contiguous [K, N] buffer
        args = _args(g, dtype, (24, 40), 36, activation="silu")
        args["weight"] = args["weight"].t().contiguous().t()
    elif variant == "tiny":
        args = _args(g, dtype, (8, 64), 24, activation="gelu", scale=1e-4)
    else:
        # pre-activations in the hundreds: the activations must neither overflow nor give inf/inf
        args = _args(g, dtype, (8, 64), 24, activation=variant.removeprefix("huge_"), scale=300.0)
    check_kernel("linear", *_bodies(tiles), args, dtype, compare_saved=("pre",) if args["activation"] else ())


def test_no_output_gradient_gives_zeros(dtype):
    g = torch.Generator().manual_seed(43)
    a = to_device(_args(g, dtype, (5, 8), 6, bias=torch.float32, activation="relu"), device())
    y, pre = k.linear_fwd(*a.values())
    dx, dw, db = k.linear_bwd(*a.values(), y, pre, None)
    for grad, inp in ((dx, a["x"]), (dw, a["weight"]), (db, a["bias"])):
        assert grad.shape == inp.shape and grad.dtype == inp.dtype and not bool(grad.any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_an_inf_reaches_only_its_own_row(dtype, activation):
    """An inf in row 1 of x reaches no other row of y or dx (a fuzzed cuda-interpret call,
    2026-12-05: torch's 16-bit CPU GEMM of dpre and the weight let row 1's NaN reach row 0)."""
    assert_nan_rows_stay(k.linear_fwd, k.linear_bwd, dtype, activation)

