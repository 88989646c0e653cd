"""The linear spec against F.linear followed by F.relu / F.gelu / F.silu in float64, forward and
gradients (torch autograd of the unfused layers), the saved pre-activation, mixed-precision bias,
zero-size dimensions and non-contiguous inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kpt

REF = kpt.get_backend("reference")
SPEC = kpt.SPECS["linear"]

UNFUSED = {
    None: lambda t: t,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _inputs(x_shape: tuple[int, ...], n: int, bias: bool, dtype: torch.dtype = torch.float64):
    g = _gen()
    x = torch.randn(*x_shape, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(n, x_shape[-1], generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(n, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", list(UNFUSED))
@pytest.mark.parametrize("x_shape, n", [((2, 16, 64), 48), ((17, 3), 5), ((100,), 7)], ids=str)
def test_matches_unfused_layers(x_shape: tuple[int, ...], n: int, activation: str | None, bias: bool) -> None:
    x, w, b = _inputs(x_shape, n, bias)
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    y = REF.linear(x, w, b, activation=activation)
    expected = UNFUSED[activation](F.linear(x, w, b))
    assert y.shape == (*x_shape[:-1], n)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(expected, leaves, dy)
    for name, got, exp in zip("xwb", torch.autograd.grad(y, leaves, dy), want):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10, msg=f"d{name}")


@pytest.mark.parametrize("activation", list(UNFUSED))
def test_pre_activation_is_saved_only_with_an_activation(activation: str | None) -> None:
    x, w, b = _inputs((5, 32), 12, bias=True)
    y, pre = SPEC.forward(x, w, b, activation)
    if activation is None:
        assert pre.numel() == 0
    else:
        torch.testing.assert_close(pre, F.linear(x, w, b), rtol=1e-13, atol=1e-13)
        assert pre.data_ptr() != y.data_ptr()


def test_relu_derivative_at_zero_is_zero_like_torch() -> None:
    x = torch.tensor([[1.0, -1.0], [2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    y = REF.linear(x, w, activation="relu")  # y[0, 0] = relu(0)
    gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    ex, ew = torch.autograd.grad(F.relu(F.linear(x, w)), (x, w), torch.ones_like(y))
    torch.testing.assert_close(gx, ex, rtol=0, atol=0)
    torch.testing.assert_close(gw, ew, rtol=0, atol=0)


def test_relu_derivative_at_nan_passes_the_gradient_like_torch() -> None:
    x = torch.tensor([[float("nan"), 1.0], [2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    w = torch.eye(2, dtype=torch.float64, requires_grad=True)  # pre = x: one NaN, one negative
    dy = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    (gx,) = torch.autograd.grad(REF.linear(x, w, activation="relu"), (x,), dy)
    (ex,) = torch.autograd.grad(F.relu(F.linear(x, w)), (x,), dy)
    torch.testing.assert_close(gx, ex, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_bias_with_16_bit_activations(dtype: torch.dtype) -> None:
    x, w, _ = _inputs((8, 64), 16, bias=False, dtype=dtype)
    b = torch.randn(16, generator=_gen(), dtype=torch.float32)
    x.requires_grad_(True)
    b.requires_grad_(True)
    y = REF.linear(x, w, b, activation="silu")
    assert y.dtype == dtype
    expected = F.silu(F.linear(x.double(), w.double(), b.double()))
    tol = kpt.default_tolerance(dtype)
    atol = tol.atol * expected.abs().max().item()
    torch.testing.assert_close(y.double(), expected, rtol=tol.rtol, atol=atol)
    dx, db = torch.autograd.grad(y, (x, b), torch.ones_like(y))
    assert dx.dtype == dtype and db.dtype == torch.float32


def test_empty_inner_dimension_gives_the_activation_of_the_bias() -> None:
    x, w, b = _inputs((4, 0), 6, bias=True)
    for t in (x, w, b):
        t.requires_grad_(True)
    y = REF.linear(x, w, b, activation="gelu")
    torch.testing.assert_close(y, F.gelu(b).expand(4, 6), rtol=1e-14, atol=1e-14)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    assert dx.shape == (4, 0) and dw.shape == (6, 0)
    torch.testing.assert_close(db, 4 * torch.autograd.grad(F.gelu(b).sum(), b)[0])


@pytest.mark.parametrize("x_shape, n", [((0, 8), 4), ((3, 8), 0)], ids=["rows", "features"])
def test_zero_size(x_shape: tuple[int, ...], n: int) -> None:
    x, w, b = _inputs(x_shape, n, bias=True)
    for t in (x, w, b):
        t.requires_grad_(True)
    y = REF.linear(x, w, b, activation="relu")
    assert y.shape == (x_shape[0], n)
    grads = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    assert [t.shape for t in grads] == [x.shape, w.shape, b.shape]
    assert all(torch.equal(t, torch.zeros_like(t)) for t in grads)


def test_non_contiguous_inputs() -> None:
    g = _gen()
    x = torch.randn(64, 24, generator=g, dtype=torch.float64).T  # [24, 64], transposed memory
    w = torch.randn(48, 64 * 2, generator=g, dtype=torch.float64)[:, ::2]  # every other column
    y, pre = SPEC.forward(x, w, None, "gelu_tanh")
    assert y.is_contiguous() and pre.is_contiguous()
    torch.testing.assert_close(y, F.gelu(F.linear(x, w), approximate="tanh"), rtol=1e-12, atol=1e-12)


def test_bad_input_messages_say_what_was_given() -> None:
    x, w, _ = _inputs((4, 8), 6, bias=False)
    with pytest.raises(kpt.KernelInputError, match=r"linear: argument 'weight' has shape \(6, 9\).*\[N, 8\]"):
        REF.linear(x, torch.randn(6, 9, dtype=torch.float64))
    with pytest.raises(kpt.KernelInputError, match=r"argument 'activation' is 'tanh'; expected one of"):
        REF.linear(x, w, activation="tanh")
