"""Linear layer with an activation fused in the epilogue.

    pre = x · weightᵀ + bias                  (float32 accumulation at least)
    y   = act(pre),   act ∈ {identity, relu, gelu (erf), gelu_tanh, silu}

Backward, with dpre = dy ⊙ act'(pre) (relu'(0) = 0 and relu'(NaN) = 1, as in torch):
    dx      = dpre · weight
    dweight = Σ_rows dpreᵀ · x
    dbias   = Σ_rows dpre

The forward saves ``pre`` (rounded to x's dtype) when there is an activation, so that the backward
needs no second pass over x · weightᵀ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from ..spec import (
    Args,
    BadInput,
    Case,
    Check,
    KernelSpec,
    compute_dtype,
    identity,
    randn,
    rows,
    strided,
    transposed,
)
from .activations import _gelu, _gelu_grad, _silu, _silu_grad


def _relu_grad(x: Tensor) -> Tensor:
    # 1 for NaN, as torch's threshold_backward: the gradient passes where x is not <= 0
    return (~(x <= 0)).to(x.dtype)


Pointwise = Callable[[Tensor], Tensor]

_ACTIVATIONS: dict[str, tuple[Pointwise, Pointwise]] = {
    "relu": (torch.relu, _relu_grad),
    "gelu": (lambda x: _gelu(x, "none"), lambda x: _gelu_grad(x, "none")),
    "gelu_tanh": (lambda x: _gelu(x, "tanh"), lambda x: _gelu_grad(x, "tanh")),
    "silu": (_silu, _silu_grad),
}
"""Each fused activation: (function, derivative), on tensors in the compute dtype."""

ACTIVATIONS = (None, *_ACTIVATIONS)


def activation_grad(activation: str) -> Pointwise:
    """The derivative of a fused activation, as the reference's backward takes it."""
    return _ACTIVATIONS[activation][1]


def linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None
) -> Tensor:
    """``act(x @ weight.T + bias)``, the activation fused in the epilogue.

    ``x``: ``[..., K]`` float; ``weight``: ``[N, K]``, x's dtype; ``bias``: ``[N]``, x's dtype or
    float32, or None; ``activation``: None, ``"relu"``, ``"gelu"`` (erf), ``"gelu_tanh"`` or
    ``"silu"``. Accumulation in float32 (float64 for float64). Returns ``y``: ``[..., N]`` in x's
    dtype. Differentiable with respect to ``x``, ``weight`` and ``bias``.
    """
    raise AssertionError("signature only: call backend.linear")


def validate_linear(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("linear", dtypes)
    x = c.tensor("x", a["x"], min_ndim=1)
    weight = c.tensor("weight", a["weight"], ndim=2)
    c.same_dtype("weight", weight, x, "x")
    c.same_device("weight", weight, x)
    if weight.shape[1] != x.shape[-1]:
        raise c.fail("weight", f"has shape {tuple(weight.shape)}; expected [N, {x.shape[-1]}] "
                               f"to match x {tuple(x.shape)}")
    c.param("bias", a["bias"], x, (weight.shape[0],))
    c.choice("activation", a["activation"], ACTIVATIONS)
    return a


def linear_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]
) -> tuple[Tensor, Tensor]:
    """Returns ``(y, pre)``: ``pre`` (x's dtype, y's shape) is empty when ``activation`` is None."""
    ct = compute_dtype(x.dtype)
    pre = rows(x).to(ct) @ weight.to(ct).T
    if bias is not None:
        pre = pre + bias.to(ct)
    shape = (*x.shape[:-1], weight.shape[0])
    if activation is None:
        return pre.to(x.dtype).reshape(shape), x.new_empty(0)
    act, _ = _ACTIVATIONS[activation]
    return act(pre).to(x.dtype).reshape(shape), pre.to(x.dtype).reshape(shape)


def linear_backward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str],
    y: Tensor, pre: Tensor, dy: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dx, dweight, dbias)``; ``dbias`` is empty when ``bias`` is None."""
    ct = compute_dtype(x.dtype)
    dpre = rows(dy).to(ct)
    if activation is not None:
        _, act_grad = _ACTIVATIONS[activation]
        dpre = dpre * act_grad(rows(pre).to(ct))
    dx = (dpre @ weight.to(ct)).to(x.dtype).reshape(x.shape)
    dweight = (dpre.T @ rows(x).to(ct)).to(weight.dtype)
    dbias = dpre.sum(0).to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx, dweight, dbias


def _flops(a: Args) -> float:
    n, k = a["weight"].shape
    return 2.0 * math.prod(a["x"].shape[:-1]) * n * k


def _make(g: torch.Generator, dtype: torch.dtype, *, x: tuple[int, ...], n: int,
          bias: bool | torch.dtype = False, activation: Optional[str] = None, scale: float = 1.0,
          layout=identity) -> Args:
    """``bias``: True for a bias in the activations' dtype, or the bias dtype."""
    k = x[-1]
    # weight ~ N(0, 1/K): pre-activations of the order of x, where the activations bend
    return {"x": layout(randn(g, *x, dtype=dtype, scale=scale)),
            "weight": layout(randn(g, n, k, dtype=dtype, scale=max(k, 1) ** -0.5)),
            "bias": randn(g, n, dtype=dtype if bias is True else bias) if bias else None,
            "activation": activation}


def _cases() -> list[Case]:
    def case(name: str, perf: bool = False, dtypes: tuple[torch.dtype, ...] | None = None,
             eager_factor: float = 0.0, **kw: Any) -> Case:
        return Case(name, lambda g, dtype: _make(g, dtype, **kw), perf=perf, dtypes=dtypes, eager_factor=eager_factor)

    return [
        case("llm", x=(4, 128, 512), n=512),
        case("bias", x=(2, 64, 256), n=384, bias=True),
        # mixed precision training: float32 bias with 16-bit activations
        case("fp32_bias", x=(64, 256), n=320, bias=torch.float32, activation="gelu_tanh",
             dtypes=(torch.float16, torch.bfloat16)),
        *(case(act, x=(2, 32, 256), n=320, bias=True, activation=act) for act in ACTIVATIONS if act),
        # no activation: a lone output next to a zero of act' has no accuracy to compare in 16 bits;
        # x·w + b may cancel, where a product rounded before the bias is added errs beyond the table
        # (fpga-sim in float32: relative error 2.6e-5 at seed 541533850): ill-conditioned
        case("single", x=(1, 1), n=1, bias=True, eager_factor=2.0),
        case("vector_x", x=(100,), n=17, activation="silu"),
        case("odd", x=(17, 3), n=33, bias=True, activation="silu"),
        case("long_k", x=(3, 1000), n=17, bias=True, activation="silu"),
        case("k_4097", x=(2, 4097), n=3),
        case("strided", x=(33, 128), n=64, bias=True, activation="gelu", layout=strided),
        # a tied embedding's weight is often the transpose of a [K, N] buffer
        case("transposed", x=(48, 128), n=96, activation="gelu_tanh", layout=transposed),
        case("zero_rows", x=(0, 64), n=32, bias=True, activation="gelu"),
        # with K = 0, dbias is the sum of dy over four rows, which may cancel: the 16-bit rounding of
        # dy then errs beyond the table relative to that sum (float16 reference: relative error
        # 5.7e-3 at seed 436440843): ill-conditioned
        case("zero_k", x=(4, 0), n=8, bias=True, activation="relu", eager_factor=2.0),
        case("zero_n", x=(4, 64), n=0, activation="silu"),
        # pre-activations in the hundreds: exp-based silu/tanh must neither overflow nor give inf/inf.
        # The rounding of a pre-activation that large moves act' by up to act''·|x||w|·eps where it
        # bends, so dweight errs beyond the table (float32 reference: 1.08x at seed 6): ill-conditioned
        case("huge_silu", x=(8, 256), n=64, activation="silu", scale=300.0, eager_factor=2.0),
        case("huge_gelu_tanh", x=(8, 256), n=64, activation="gelu_tanh", scale=300.0, eager_factor=2.0),
        case("tiny", x=(8, 256), n=64, activation="gelu", scale=1e-4),
        case("perf", x=(8192, 8192), n=8192, perf=True),
    ]


def _bad_inputs() -> list[BadInput]:
    def base(**kw: Any) -> Args:
        return {"x": torch.randn(4, 8), "weight": torch.randn(6, 8), "bias": None, "activation": None, **kw}

    return [
        BadInput("int_x", lambda: base(x=torch.ones(4, 8, dtype=torch.int64))),
        BadInput("scalar_x", lambda: base(x=torch.tensor(1.0))),
        BadInput("not_a_tensor", lambda: base(weight=[[1.0] * 8])),
        BadInput("weight_rank", lambda: base(weight=torch.randn(8))),
        BadInput("weight_in_features", lambda: base(weight=torch.randn(6, 9))),
        BadInput("weight_dtype", lambda: base(weight=torch.randn(6, 8, dtype=torch.float64))),
        BadInput("weight_device", lambda: base(weight=torch.randn(6, 8, device="meta"))),
        BadInput("bias_shape", lambda: base(bias=torch.randn(8))),
        BadInput("bias_dtype", lambda: base(bias=torch.randn(6, dtype=torch.float16))),
        BadInput("activation_unknown", lambda: base(activation="tanh")),
        BadInput("activation_none_string", lambda: base(activation="none")),
    ]


LINEAR = KernelSpec(
    name="linear",
    signature=linear,
    validate=validate_linear,
    forward=linear_forward,
    backward=linear_backward,
    outputs=("y",),
    saved=("pre",),
    differentiable=("x", "weight", "bias"),
    flops=_flops,
    cases=_cases,
    bad_inputs=_bad_inputs,
)

SPECS = (LINEAR,)
