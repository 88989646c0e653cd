"""The gelu, silu, swiglu and geglu specs against ``F.gelu`` / ``F.silu`` (float64) and the edge
semantics of the contract."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import kpt

REF = kpt.get_backend("reference")

TORCH: dict[str, Callable[..., torch.Tensor]] = {
    "gelu": lambda x, approximate: F.gelu(x, approximate=approximate),
    "silu": lambda x: F.silu(x),
    "swiglu": lambda gate, up: F.silu(gate) * up,
    "geglu": lambda gate, up, approximate: F.gelu(gate, approximate=approximate) * up,
}
PARAMS = [pytest.param(name, case, id=f"{name}-{case.name}")
          for name in TORCH for case in kpt.SPECS[name].cases() if not case.device_only]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("name, case", PARAMS)
def test_forward_and_backward_match_torch(name: str, case: kpt.Case) -> None:
    g = _generator()
    args = case.make(g, torch.float64)
    tensors = {k: v.detach().requires_grad_(True) for k, v in args.items() if isinstance(v, torch.Tensor)}
    args.update(tensors)
    y = getattr(REF, name)(**args)
    expected = TORCH[name](**args)
    # F.gelu loses the far negative tail (1 + erf cancels) where the reference keeps it: atol
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
    assert y.is_contiguous() and y.shape == expected.shape and y.dtype == expected.dtype

    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(y, list(tensors.values()), dy)
    want = torch.autograd.grad(expected, list(tensors.values()), dy)
    for arg, a, e in zip(tensors, got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12, msg=f"{name}: d{arg}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_saturation_is_finite(name: str, dtype: torch.dtype) -> None:
    # exp(±x) overflows float32 beyond |x| ≈ 88: act(x) → 0 on the left, → x on the right, act' → 0 / 1
    x = torch.tensor([-6e4, -1e3, -100.0, 100.0, 1e3, 6e4]).to(dtype).requires_grad_(True)
    kw = {"approximate": "tanh"} if name == "gelu_tanh" else {}
    y = getattr(REF, name.removesuffix("_tanh"))(x, **kw)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    right = x.detach() > 0
    torch.testing.assert_close(y.float(), torch.where(right, x.detach(), 0).float())
    torch.testing.assert_close(dx.float(), right.float())


def test_gelu_keeps_the_negative_tail() -> None:
    # Φ(x) = ½ erfc(−x/√2): correct to the last bits where 1 + erf(x/√2) would round to 0
    xs = [-12.0, -10.0, -7.5, -5.0, -3.0, -1.0]
    exact = torch.tensor([x * 0.5 * math.erfc(-x / math.sqrt(2)) for x in xs], dtype=torch.float64)
    for dtype, rtol in [(torch.float64, 1e-12), (torch.float32, 1e-5)]:
        y = REF.gelu(torch.tensor(xs, dtype=dtype))
        torch.testing.assert_close(y.double(), exact, rtol=rtol, atol=0)


def test_default_approximations() -> None:
    # F.gelu's default for gelu, Gemma's tanh form for geglu
    assert inspect.signature(REF.gelu).parameters["approximate"].default == "none"
    assert inspect.signature(REF.geglu).parameters["approximate"].default == "tanh"
    g = _generator()
    gate, up = torch.randn(2, 64, 64, generator=g, dtype=torch.float64)
    torch.testing.assert_close(REF.geglu(gate, up), F.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(REF.gelu(gate), F.gelu(gate))


def test_errors_name_the_argument() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(kpt.KernelInputError, match="gelu: argument 'approximate' is 'erf'"):
        REF.gelu(x, approximate="erf")
    with pytest.raises(kpt.KernelInputError, match="swiglu: argument 'up' has shape"):
        REF.swiglu(x, torch.randn(1, 8))
    with pytest.raises(kpt.KernelInputError, match="geglu: argument 'up' has dtype"):
        REF.geglu(x, x.double())
