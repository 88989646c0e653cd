"""The layer_norm spec against ``F.layer_norm`` (float64) and the edge semantics of the contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kpt

REF = kpt.get_backend("reference")
SPEC = kpt.SPECS["layer_norm"]
# float64 runs of every numerics case (the float32-parameter case exists only for 16-bit activations)
CASES = [c for c in SPEC.cases() if not c.device_only and c.dtypes is None]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_backward_match_torch(case: kpt.Case) -> None:
    g = _generator()
    args = case.make(g, torch.float64)
    leaves = {k: v.detach().requires_grad_(True) for k, v in args.items() if isinstance(v, torch.Tensor)}
    x, w, b = leaves["x"], leaves.get("weight"), leaves.get("bias")
    y = REF.layer_norm(x, w, b, args["eps"])
    expected = F.layer_norm(x, (x.shape[-1],), w, b, args["eps"])
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    assert y.is_contiguous() and y.dtype == x.dtype

    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    inputs = list(leaves.values())
    got = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(expected, inputs, dy)
    for name, a, e in zip(leaves, got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def test_statistics_are_the_biased_mean_and_variance() -> None:
    x = torch.randn(6, 5, 300, generator=_generator(), dtype=torch.float64) * 3 + 2
    _, mean, rstd = SPEC.forward(x, None, None, 1e-5)
    var, expected_mean = torch.var_mean(x.reshape(-1, 300), dim=-1, correction=0)
    torch.testing.assert_close(mean, expected_mean)
    torch.testing.assert_close(rstd, (var + 1e-5).rsqrt())


def test_saved_statistics_are_float32_for_16bit_input() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(3, 64, generator=_generator()).to(dtype)
        y, mean, rstd = SPEC.forward(x, None, None, 1e-5)
        assert (y.dtype, mean.dtype, rstd.dtype) == (dtype, torch.float32, torch.float32)
        assert mean.shape == rstd.shape == (3,)


def test_constant_rows_give_the_bias() -> None:
    # zero variance: rstd = eps^-½ stays finite and the centred row vanishes (up to the mean's rounding)
    g = _generator()
    x = torch.randn(7, 1, generator=g, dtype=torch.float64).expand(7, 128)
    w, b = torch.randn(2, 128, generator=g, dtype=torch.float64)
    y = REF.layer_norm(x, w, b)
    torch.testing.assert_close(y, b.expand(7, 128), rtol=0, atol=1e-10)


def test_zero_size_inputs() -> None:
    w = torch.ones(0)
    for shape in [(4, 0), (0, 16), (2, 0, 3)]:
        x = torch.randn(shape)
        y, mean, rstd = SPEC.forward(x, w if shape[-1] == 0 else None, None, 1e-5)
        assert y.shape == x.shape and mean.shape == rstd.shape == (math.prod(shape[:-1]),)
        assert torch.isfinite(mean).all() and torch.isfinite(rstd).all()


def test_two_pass_variance_in_float32() -> None:
    # |mean| / std = 1000: E[x²] − E[x]² in float32 would lose every digit of the variance
    x = torch.randn(16, 2048, generator=_generator()) + 1000.0
    y = REF.layer_norm(x)
    expected = F.layer_norm(x.double(), (2048,))
    assert (y.double() - expected).abs().max() < 1e-3


def test_mixed_precision_parameters() -> None:
    g = _generator()
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(256, generator=g) + 1).requires_grad_(True)
    b = torch.randn(256, generator=g).requires_grad_(True)
    y = REF.layer_norm(x, w, b)
    assert y.dtype == torch.bfloat16
    expected = F.layer_norm(x.double(), (256,), w.double(), b.double())
    torch.testing.assert_close(y.double(), expected, rtol=1.6e-2, atol=1.6e-2)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.randn(y.shape, generator=g).to(torch.bfloat16))
    assert (dx.dtype, dw.dtype, db.dtype) == (torch.bfloat16, torch.float32, torch.float32)


def test_errors_name_the_argument() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(kpt.KernelInputError, match="layer_norm: argument 'bias' has shape"):
        REF.layer_norm(x, torch.ones(8), torch.zeros(7))
    with pytest.raises(kpt.KernelInputError, match="layer_norm: argument 'weight' has dtype"):
        REF.layer_norm(x, torch.ones(8, dtype=torch.float16))
    with pytest.raises(kpt.KernelInputError, match="layer_norm: argument 'eps'"):
        REF.layer_norm(x, eps=-1.0)
