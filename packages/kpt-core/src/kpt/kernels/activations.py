"""Pointwise activations and gated linear units: ``gelu``, ``silu``, ``swiglu``, ``geglu``.

    gelu(x) = x · Φ(x) = ½ x · erfc(−x / √2)                          approximate="none"
            ≈ ½ x · (1 + tanh(u)),  u = √(2/π) · (x + 0.044715 x³)       approximate="tanh"
    silu(x) = x · σ(x)
    swiglu(gate, up) = silu(gate) · up
    geglu(gate, up)  = gelu(gate) · up

Derivatives, with φ(x) = exp(−x²/2) / √(2π) and t = tanh(u):
    gelu'(x) = Φ(x) + x · φ(x)                                             approximate="none"
             = ½ (1 + t) + ½ x · (1 − t²) · √(2/π) · (1 + 3 · 0.044715 x²)   approximate="tanh"
    silu'(x) = σ(x) · (1 + x · (1 − σ(x)))
    gated:   dgate = dy · up · act'(gate),   dup = dy · act(gate)

Everything is computed in float32 (float64 for float64) and rounded once to the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..spec import Args, BadInput, Case, Check, KernelSpec, compute_dtype, identity, randn, row_cases

APPROXIMATIONS = ("none", "tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit, like ``F.gelu(x, approximate=approximate)``.

    ``approximate="none"``: ``x · Φ(x)`` with the exact normal CDF (erf);
    ``approximate="tanh"``: ``½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))``.
    ``x``: any shape with at least one dimension. Returns ``y`` like x.
    Differentiable with respect to ``x``.
    """
    raise AssertionError("signature only: call backend.gelu")


def silu(x: Tensor) -> Tensor:
    """Sigmoid linear unit (swish), like ``F.silu(x)``: ``x · sigmoid(x)``.

    ``x``: any shape with at least one dimension. Returns ``y`` like x.
    Differentiable with respect to ``x``.
    """
    raise AssertionError("signature only: call backend.silu")


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU gating of a gated MLP (Llama): ``silu(gate) · up``.

    ``gate`` and ``up``: the same shape (at least one dimension), dtype and device.
    Returns ``y`` like gate. Differentiable with respect to ``gate`` and ``up``.
    """
    raise AssertionError("signature only: call backend.swiglu")


def geglu(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """GeGLU gating of a gated MLP (Gemma): ``gelu(gate, approximate) · up``.

    ``gate`` and ``up``: the same shape (at least one dimension), dtype and device;
    ``approximate``: ``"tanh"`` (the default, as Gemma uses) or ``"none"``, as for `gelu`.
    Returns ``y`` like gate. Differentiable with respect to ``gate`` and ``up``.
    """
    raise AssertionError("signature only: call backend.geglu")


def validate_gelu(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("gelu", dtypes)
    c.tensor("x", a["x"], min_ndim=1)
    c.choice("approximate", a["approximate"], APPROXIMATIONS)
    return a


def validate_silu(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    Check("silu", dtypes).tensor("x", a["x"], min_ndim=1)
    return a


def _check_gated(c: Check, gate: object, up: object) -> None:
    gate = c.tensor("gate", gate, min_ndim=1)
    up = c.tensor("up", up)
    c.same_dtype("up", up, gate, "gate")
    c.shape("up", up, tuple(gate.shape))
    c.same_device("up", up, gate)


def validate_swiglu(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    _check_gated(Check("swiglu", dtypes), a["gate"], a["up"])
    return a


def validate_geglu(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("geglu", dtypes)
    _check_gated(c, a["gate"], a["up"])
    c.choice("approximate", a["approximate"], APPROXIMATIONS)
    return a


# ---------------------------------------------------------------------------------------------
# The math, on tensors already in the compute dtype.


def _gelu(x: Tensor, approximate: str) -> Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x**3)))
    # erfc keeps full relative precision in the negative tail, where 1 + erf cancels
    return 0.5 * x * torch.erfc(-x * math.sqrt(0.5))


def _gelu_grad(x: Tensor, approximate: str) -> Tensor:
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
    cdf = 0.5 * torch.erfc(-x * math.sqrt(0.5))
    return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _silu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def _silu_grad(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _up(t: Tensor) -> Tensor:
    return t.to(compute_dtype(t.dtype))


def _out(t: Tensor, like: Tensor) -> Tensor:
    # elementwise results follow the input's memory layout; outputs must be contiguous
    return t.to(like.dtype).contiguous()


# ---------------------------------------------------------------------------------------------
# Reference forward and backward of each kernel.


def gelu_forward(x: Tensor, approximate: str) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_gelu(_up(x), approximate), x),)


def gelu_backward(x: Tensor, approximate: str, y: Tensor, dy: Tensor) -> tuple[Tensor]:
    """Returns ``(dx,)``."""
    return (_out(_up(dy) * _gelu_grad(_up(x), approximate), x),)


def silu_forward(x: Tensor) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_silu(_up(x)), x),)


def silu_backward(x: Tensor, y: Tensor, dy: Tensor) -> tuple[Tensor]:
    """Returns ``(dx,)``."""
    return (_out(_up(dy) * _silu_grad(_up(x)), x),)


def swiglu_forward(gate: Tensor, up: Tensor) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_silu(_up(gate)) * _up(up), gate),)


def swiglu_backward(gate: Tensor, up: Tensor, y: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """Returns ``(dgate, dup)``."""
    g, d = _up(gate), _up(dy)
    return _out(d * _up(up) * _silu_grad(g), gate), _out(d * _silu(g), up)


def geglu_forward(gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_gelu(_up(gate), approximate) * _up(up), gate),)


def geglu_backward(
    gate: Tensor, up: Tensor, approximate: str, y: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor]:
    """Returns ``(dgate, dup)``."""
    g, d = _up(gate), _up(dy)
    return _out(d * _up(up) * _gelu_grad(g, approximate), gate), _out(d * _gelu(g, approximate), up)


# ---------------------------------------------------------------------------------------------
# Cost model (a transcendental function counts as one flop) and conformance cases.


def _per_element(n: float, arg: str):
    def flops(a: Args) -> float:
        return n * a[arg].numel()
    return flops


MLP_SHAPE = (16384, 11008)
"""The intermediate activation of a 7B-class gated MLP (PERF.md's swiglu/geglu shape)."""


def _transposed(t: Tensor) -> Tensor:
    """The same values as a dense but transposed view: elementwise outputs must still be contiguous."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _make_x(**extra):
    def make(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
             layout=identity) -> Args:
        return {"x": layout(randn(g, *shape, dtype=dtype, scale=scale)), **extra}
    return make


def _make_gated(**extra):
    def make(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
             layout=identity) -> Args:
        # only the gate is scaled: the product must stay finite in float16 (|y| < 6.5e4)
        gate = layout(randn(g, *shape, dtype=dtype, scale=scale))
        return {"gate": gate, "up": layout(randn(g, *shape, dtype=dtype)), **extra}
    return make


def _case(name: str, make, **kw) -> Case:
    return Case(name, lambda g, dtype: make(g, dtype, **kw))


def _pointwise_cases(make, other) -> list[Case]:
    """The row-wise cases, a transposed layout, and a few with the other ``approximate`` (if any)."""
    cases = row_cases(make, MLP_SHAPE) + [_case("transposed", make, shape=(256, 96), layout=_transposed)]
    if other is not None:
        cases += [_case(f"{other['approximate']}_{name}", other, **kw) for name, kw in
                  [("wide", dict(shape=(17, 1000))), ("huge", dict(shape=(8, 2048), scale=1e4))]]
    return cases


def _gated_cases(make, other) -> list[Case]:
    cases = row_cases(make, MLP_SHAPE, extreme=False) + [
        _case("transposed", make, shape=(256, 96), layout=_transposed),
        # |gate| up to ~450: exp(|gate|) overflows float32, so a naive sigmoid or tanh gives inf/inf
        _case("huge_gate", make, shape=(8, 2048), scale=100.0),
        _case("tiny_gate", make, shape=(8, 2048), scale=1e-4),
    ]
    if other is not None:
        cases += [_case(f"{other.approximate}_{name}", other.make, **kw) for name, kw in
                  [("wide", dict(shape=(17, 1000))), ("huge_gate", dict(shape=(8, 2048), scale=100.0))]]
    return cases
