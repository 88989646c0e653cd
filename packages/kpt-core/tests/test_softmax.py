"""The softmax spec against ``F.softmax`` (float64) and the edge semantics of the contract."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kpt

REF = kpt.get_backend("reference")
SPEC = kpt.SPECS["softmax"]
CASES = [c for c in SPEC.cases() if not c.device_only]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_backward_match_torch(case: kpt.Case) -> None:
    g = _generator()
    args = case.make(g, torch.float64)
    x = args["x"].detach().requires_grad_(True)
    y = REF.softmax(x, args["dim"])
    expected = F.softmax(x, args["dim"])
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
    assert y.is_contiguous() and y.shape == x.shape
    if case.grad:
        dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
        (got,) = torch.autograd.grad(y, x, dy)
        (want,) = torch.autograd.grad(expected, x, dy)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_no_overflow_at_extreme_magnitudes(dtype: torch.dtype) -> None:
    # exp(±6e4) is far outside every float format: only the max subtraction keeps this finite
    x = torch.tensor([[6e4, 0.0, -6e4], [-6e4, -6e4, -6e4], [6e4, 6e4, -6e4]]).to(dtype)
    y = REF.softmax(x)
    expected = torch.tensor([[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]])
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=4e-3)


def test_rows_sum_to_one_and_shift_invariance() -> None:
    g = _generator()
    x = torch.randn(9, 333, generator=g, dtype=torch.float64) * 5
    shift = torch.randn(9, 1, generator=g, dtype=torch.float64) * 1e3
    y = REF.softmax(x)
    torch.testing.assert_close(y.sum(-1), torch.ones(9, dtype=torch.float64))
    torch.testing.assert_close(REF.softmax(x + shift), y)


def test_ties_share_probability_equally() -> None:
    x = torch.randn(5, 1, generator=_generator()).expand(5, 40)
    assert torch.equal(REF.softmax(x), torch.full((5, 40), 1 / 40))


def test_dim_is_normalized_for_kernel_bodies() -> None:
    x = torch.randn(2, 3, 4)
    for dim, expected in [(-1, 2), (-3, 0), (1, 1)]:
        assert SPEC.validate(SPEC.bind((x,), {"dim": dim}), kpt.FLOAT_DTYPES)["dim"] == expected


@pytest.mark.parametrize("shape, dim", [((4, 0), -1), ((0, 8), -1), ((3, 0, 5), 1), ((3, 0, 5), 2)])
def test_zero_size(shape: tuple[int, ...], dim: int) -> None:
    x = torch.randn(shape, requires_grad=True)
    y = REF.softmax(x, dim)
    assert y.shape == x.shape
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert dx.shape == x.shape


def test_errors_name_the_argument() -> None:
    with pytest.raises(kpt.KernelInputError, match="softmax: argument 'dim' is 2"):
        REF.softmax(torch.randn(4, 8), 2)
    with pytest.raises(kpt.KernelInputError, match="softmax: argument 'x' has dtype torch.int64"):
        REF.softmax(torch.ones(4, 8, dtype=torch.int64))
