"""The torch products (`kpt_triton.products`): linear through torch.addmm then torch's activation,
grouped_linear through torch._grouped_mm (bfloat16, aligned rows) or a loop of torch.mm, each
against its spec's float64 reference; bad offsets as the contract reads them."""

from __future__ import annotations

import pytest
import torch

import kpt
from conftest import assert_nan_rows_stay, check_kernel, device, seeded
from kpt.kernels.moe import GROUPED_LINEAR
from kpt.spec import randn, strided, transposed
from kpt_triton import products as p

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


SHAPES = {"odd": ((2, 17, 40), 33, "same"), "zero_k": ((5, 0), 8, "float32"), "zero_rows": ((0, 16), 8, None)}
LINEAR = [*(("odd", a) for a in ACTIVATIONS), ("zero_k", "relu"), ("zero_rows", None)]


@pytest.mark.parametrize("shape, activation", LINEAR, ids=[f"{s}-{a}" for s, a in LINEAR])
def test_linear(dtype, shape, activation):
    x_shape, n, bias = SHAPES[shape]
    g = seeded(activation, str(dtype), x_shape)
    k = x_shape[-1]
    args = {"x": strided(randn(g, *x_shape, dtype=dtype)),
            "weight": randn(g, n, k, dtype=dtype, scale=max(k, 1) ** -0.5),
            "bias": None if bias is None else randn(g, n, dtype=dtype if bias == "same" else torch.float32),
            "activation": activation}
    check_kernel("linear", p.linear_fwd, p.linear_bwd, args, dtype, compare_saved=("pre",) if activation else ())


def test_relu_epilogue_passes_nan_on():
    x = torch.tensor([[float("nan")], [-1.0], [-0.0], [0.0], [2.0]], device=device())
    y, _ = p.linear_fwd(x, torch.ones(1, 1, device=device()), None, "relu")
    assert y[0, 0].isnan() and y[1:, 0].tolist() == [0.0, 0.0, 0.0, 2.0]


@pytest.mark.parametrize("activation", ACTIVATIONS[1:])
def test_activations_of_infinities_as_the_reference(activation):
    """act(±inf) is the reference math's (gelu(+inf) = +inf: torch's CPU gelu gives NaN)."""
    x = torch.tensor([[float("inf")], [-float("inf")]])
    y, _ = p.linear_fwd(x.to(device()), torch.ones(1, 1, device=device()), None, activation)
    expected = kpt.get_backend("reference").linear(x.double(), torch.ones(1, 1, dtype=torch.float64),
                                                   activation=activation)
    assert torch.equal(y.cpu().double().isnan(), expected.isnan())
    assert torch.equal(y.cpu().double().nan_to_num(), expected.nan_to_num())


OFFSETS = {  # rows, experts, offsets: as drawn, or bad values the contract clamps (expert_bounds)
    "routed": (40, 4, [0, 10, 10, 25, 40]),
    "rows_before_and_after": (40, 3, [5, 12, 30, 33]),
    "decreasing_and_out_of_range": (24, 4, [-3, 20, 8, 99, 12]),
    "zero_rows": (0, 2, [0, 0, 0]),
}


@pytest.mark.parametrize("k_n", [(16, 24), (17, 5)], ids=["aligned", "odd"])
@pytest.mark.parametrize("case", OFFSETS.values(), ids=OFFSETS.keys())
def test_grouped_linear(dtype, case, k_n):
    """bfloat16 with aligned K and N runs torch._grouped_mm, everything else the torch.mm loop."""
    rows, experts, offsets = case
    k, n = k_n
    g = torch.Generator().manual_seed(rows * 31 + k)
    args = {"x_sorted": randn(g, rows, k, dtype=dtype),
            "offsets": torch.tensor(offsets, dtype=torch.int32),
            "weight": transposed(randn(g, experts, n, k, dtype=dtype, scale=k**-0.5))}
    check_kernel("grouped_linear", p.grouped_linear_fwd, p.grouped_linear_bwd, args, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["grouped_mm", "mm_loop"])
def test_grouped_linear_rows_of_no_expert_reach_nothing(dtype):
    """NaN in the rows outside every expert: zeros in y and dx, and no NaN in dweight."""
    dev = device()
    x = torch.randn(32, 16, device=dev).to(dtype)
    x[:4] = float("nan")
    x[28:] = float("nan")
    offsets = torch.tensor([4, 10, 28], dtype=torch.int32, device=dev)
    weight = torch.randn(2, 8, 16, device=dev).to(dtype)
    (y,) = p.grouped_linear_fwd(x, offsets, weight)
    dx, dweight = p.grouped_linear_bwd(x, offsets, weight, y, torch.ones_like(y))
    assert not y[:4].any() and not y[28:].any() and not y[4:28].isnan().any()
    assert not dx[:4].any() and not dx[28:].any()
    assert not dweight.isnan().any()
    expected = GROUPED_LINEAR.forward(x[4:28].double(), offsets - 4, weight.double())[0]
    torch.testing.assert_close(y[4:28].double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_linear_an_inf_reaches_only_its_own_row(dtype, activation):
    """As kpt-triton's own linear (`test_linear.test_an_inf_reaches_only_its_own_row`)."""
    assert_nan_rows_stay(p.linear_fwd, p.linear_bwd, dtype, activation)
