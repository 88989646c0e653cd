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
    PARTIAL,
    Args,
    BadInput,
    Case,
    Check,
    KernelSpec,
    Strategy,
    compute_dtype,
    finite,
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


def linear_fwd(
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


def linear_bwd(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str],
    y: Tensor, pre: Tensor, dy: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dx, dweight, dbias)``; ``dbias`` is empty when ``bias`` is None."""
    ct = compute_dtype(x.dtype)
    dpre = rows(dy if dy is not None else torch.zeros_like(y)).to(ct)
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


def rounding_sums(d: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """`rounded_operand`'s three sums before `summed` takes them: ``(bounds, squares)`` for
    ``d · w``, ``dᵀ · x`` and the column sums, which a caller working through rows of ``d`` adds up
    chunk by chunk (the last two)."""
    e = torch.finfo(dtype).eps / 2 * d.abs()
    e2 = e.square()
    return (e @ w.abs(), e2 @ w.square()), (e.T @ x.abs(), e2.T @ x.square()), (e.sum(0), e2.sum(0))


def summed(bounds: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
    """A sum of roundings (`rounding_sums`): the sum of their bounds, or three deviations if that is less."""
    return torch.minimum(bounds, math.sqrt(3) * squares.sqrt())


def rounded_operand(d: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What rounding ``d`` ``[M, N]`` to ``dtype`` before the products ``d · w`` (``w``: ``[N, K]``)
    and ``dᵀ · x`` (``x``: ``[M, K]``) and the column sums ``Σ_i d_ij`` moves those three by.

    Each element of ``d`` carries up to ``u · |d|`` (u the unit roundoff of ``dtype``), a rounding
    of standard deviation at most ``u · |d| / √3``; a sum of such terms moves by at most the sum of
    their bounds and, their signs independent, by three standard deviations of the sum at most
    ``√3 · u · ‖terms‖₂``: the smaller of the two. Far beyond a bound relative to the result where
    its terms nearly cancel (the column sum of a few rows), a small part of it elsewhere."""
    dx, dw, db = rounding_sums(d, x, w, dtype)
    return summed(*dx), summed(*dw), summed(*db)


def linear_rounded_dpre(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Linear's `RoundingAllowance`: what rounding ``dpre = dy ⊙ act'(pre)`` to the inputs'
    ``dtype`` (the operand of the products ``dx = dpre · weight`` and ``dweight = dpreᵀ · x`` in
    that dtype, and of dbias's sum) moves the gradients by (`kpt.tolerance`), bounded as
    `rounded_operand` does.

    Float64 from the oracle's checked arguments (x, weight, bias, activation) and ``{"dy": dy}``."""
    x, w = (finite(t.detach().to(torch.float64)) for t in (rows(args["x"]), args["weight"]))
    dy = finite(rows(upstream["dy"]).detach().to(torch.float64))
    bias, activation = args["bias"], args["activation"]
    pre = x @ w.T + (0.0 if bias is None else finite(bias.detach().to(torch.float64)))
    dpre = dy if activation is None else finite(dy * activation_grad(activation)(pre))
    dx, dw, db = rounded_operand(dpre, x, w, dtype)
    allowance = {"x": dx.reshape(args["x"].shape), "weight": dw}
    return allowance if bias is None else {**allowance, "bias": db}


def linear_relu_kernel_side(args: Args, upstream: Args, outputs: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Linear's second oracle for relu (`KernelSpec.kink`): the gradients with relu' taken on the side of 0
    that the backend's own forward shows (``y > 0``) wherever the oracle's pre-activation lies
    within the forward's rounding of 0, the oracle's relu' elsewhere (float64).

    relu' jumps from 0 to 1 at 0, so a pre-activation that the forward's rounding can move across
    0 may take either derivative — but the backward must take the one its forward took. That
    rounding is ``K · u_acc · Σ_k |x_ik · weight_jk|`` for float32 accumulation (u_acc of float64
    for float64), plus ``u · Σ_k |x_ik · weight_jk|`` for 16-bit inputs (u of ``dtype``), whose
    products may round the partial sums of a split reduction to the inputs' dtype (cuBLAS under
    torch's default ``allow_bf16_reduced_precision_reduction``), and below float32's smallest
    normal (flushed) or the dtype's smallest subnormal (rounded to 0) any value may land on 0.
    ``args``: the oracle's checked x, weight, bias, activation; ``upstream``: ``{"dy": dy}``;
    ``outputs``: the backend's ``{"y": y}``. Empty for every other activation."""
    if args["activation"] != "relu":
        return {}
    x, w, dy = (t.detach().to(torch.float64) for t in (rows(args["x"]), args["weight"], rows(upstream["dy"])))
    bias = args["bias"]
    pre = x @ w.T + (0.0 if bias is None else bias.detach().to(torch.float64))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    u = torch.finfo(acc).eps / 2 * x.shape[-1] + (torch.finfo(dtype).eps / 2 if dtype.itemsize == 2 else 0.0)
    zero = max(torch.finfo(acc).tiny, torch.finfo(dtype).tiny * torch.finfo(dtype).eps)
    near = pre.abs() <= u * (finite(x).abs() @ finite(w).abs().T) + zero
    kernel_side = rows(outputs["y"]).detach().to(pre.device, torch.float64) > 0
    dpre = dy * torch.where(near, kernel_side, ~(pre <= 0))  # relu'(NaN) = 1, as the reference's
    # the reference's backward from that dpre (no activation left to apply)
    dx, dweight, dbias = linear_bwd(args["x"].detach().to(torch.float64), w,
                                         None if bias is None else bias.detach().to(torch.float64),
                                         None, pre, pre, dpre)
    grads = {"x": dx, "weight": dweight}
    return grads if bias is None else {**grads, "bias": dbias}


def _sharding(a: Args) -> list[Strategy]:
    """Any leading dimension of x sharded; the column-wise plan (weight rows sharded, output
    sharded over features); without an activation the row-wise plan (input features and weight
    columns sharded, the output a partial sum, the bias added on one rank's share)."""
    last = a["x"].ndim - 1
    pre = a["activation"] is not None  # the pre-activation is saved only with an activation
    strategies: list[Strategy] = [({"y": d, **({"pre": d} if pre else {})}, {"x": d}) for d in range(last)]
    strategies.append(({"y": last, **({"pre": last} if pre else {})}, {"weight": 0, "bias": 0}))
    if not pre:  # a partial sum goes through no activation
        strategies.append(({"y": PARTIAL}, {"x": last, "weight": 1, "bias": PARTIAL}))
    return strategies


LINEAR = KernelSpec(
    name="linear",
    signature=linear,
    validate=validate_linear,
    forward=linear_fwd,
    backward=linear_bwd,
    outputs=("y",),
    saved=("pre",),
    differentiable=("x", "weight", "bias"),
    flops=_flops,
    cases=_cases,
    bad_inputs=_bad_inputs,
    sharding=_sharding,
    rounding=linear_rounded_dpre,
    kink=linear_relu_kernel_side,
)

SPECS = (LINEAR,)
