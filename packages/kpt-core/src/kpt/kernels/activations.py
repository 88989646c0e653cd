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
from collections.abc import Callable

import torch
from torch import Tensor

from ..spec import (
    Args,
    BadInput,
    Case,
    Check,
    KernelSpec,
    Sharding,
    compute_dtype,
    each_dim,
    identity,
    randn,
    row_cases,
)

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
    c.shape("up", up, gate.shape)
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


def gelu_fwd(x: Tensor, approximate: str) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_gelu(_up(x), approximate), x),)


def gelu_bwd(x: Tensor, approximate: str, y: Tensor, dy: Tensor) -> tuple[Tensor]:
    """Returns ``(dx,)``."""
    return (_out(_up(dy) * _gelu_grad(_up(x), approximate), x),)


def silu_fwd(x: Tensor) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_silu(_up(x)), x),)


def silu_bwd(x: Tensor, y: Tensor, dy: Tensor) -> tuple[Tensor]:
    """Returns ``(dx,)``."""
    return (_out(_up(dy) * _silu_grad(_up(x)), x),)


def swiglu_fwd(gate: Tensor, up: Tensor) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_silu(_up(gate)) * _up(up), gate),)


def swiglu_bwd(gate: Tensor, up: Tensor, y: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """Returns ``(dgate, dup)``."""
    g, d = _up(gate), _up(dy)
    return _out(d * _up(up) * _silu_grad(g), gate), _out(d * _silu(g), up)


def geglu_fwd(gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    return (_out(_gelu(_up(gate), approximate) * _up(up), gate),)


def geglu_bwd(
    gate: Tensor, up: Tensor, approximate: str, y: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor]:
    """Returns ``(dgate, dup)``."""
    g, d = _up(gate), _up(dy)
    return _out(d * _up(up) * _gelu_grad(g, approximate), gate), _out(d * _gelu(g, approximate), up)


# ---------------------------------------------------------------------------------------------
# Cost model (a transcendental function counts as one flop) and conformance cases.


def _per_element(n: float, arg: str) -> Callable[[Args], float]:
    def flops(a: Args) -> float:
        return n * a[arg].numel()
    return flops


MLP_SHAPE = (16384, 11008)
"""The intermediate activation of a 7B-class gated MLP (docs/performance.md's swiglu/geglu shape)."""


def _make_x(**extra: object) -> Callable[..., Args]:
    def make(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
             layout=identity) -> Args:
        return {"x": layout(randn(g, *shape, dtype=dtype, scale=scale)), **extra}
    return make


def _make_gated(**extra: object) -> Callable[..., Args]:
    def make(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
             layout=identity) -> Args:
        # only the gate is scaled (see _cases): up stays O(1)
        gate = layout(randn(g, *shape, dtype=dtype, scale=scale))
        return {"gate": gate, "up": layout(randn(g, *shape, dtype=dtype)), **extra}
    return make


def _case(name: str, make: Callable[..., Args], **kw) -> Case:
    return Case(name, lambda g, dtype: make(g, dtype, **kw))


def _cases(make: Callable[..., Args], *, gated: bool,
           alternative: tuple[str, Callable[..., Args]] | None = None) -> Callable[[], list[Case]]:
    """Row-wise shapes, a transposed layout and extreme magnitudes; ``alternative``
    (``approximate`` value, make) adds a few cases with the non-default approximation."""
    # |x| ≫ 88 overflows exp in float32 (a naive sigmoid or tanh gives inf/inf); a gate is scaled
    # less than a lone input so that gate·up and dy·act(gate) stay below float16's 6.5e4
    scale = 100.0 if gated else 1e4

    def cases() -> list[Case]:
        out = row_cases(make, MLP_SHAPE, extreme=False) + [
            # dense but transposed: elementwise results follow that layout unless made contiguous
            _case("transposed", make, shape=(256, 96), layout=torch.t),
            _case("huge", make, shape=(8, 2048), scale=scale),
            _case("tiny", make, shape=(8, 2048), scale=1e-4),
        ]
        if alternative is not None:
            name, alt = alternative
            out += [_case(f"{name}_wide", alt, shape=(17, 1000)),
                    _case(f"{name}_huge", alt, shape=(8, 2048), scale=scale)]
        return out
    return cases


def _bad_inputs(kernel: str) -> Callable[[], list[BadInput]]:
    gated = kernel in ("swiglu", "geglu")
    has_approximate = kernel in ("gelu", "geglu")

    def bad() -> list[BadInput]:
        first = "gate" if gated else "x"
        base: Args = {first: torch.randn(4, 8)}
        if gated:
            base["up"] = torch.randn(4, 8)
        if has_approximate:
            base["approximate"] = "tanh"
        out = [
            BadInput(f"int_{first}", lambda: {**base, first: torch.ones(4, 8, dtype=torch.int64)}),
            BadInput(f"scalar_{first}", lambda: {**base, first: torch.tensor(1.0)}),
            BadInput("not_a_tensor", lambda: {**base, first: [[1.0, 2.0]]}),
        ]
        if gated:
            out += [
                BadInput("up_shape", lambda: {**base, "up": torch.randn(4, 9)}),
                BadInput("up_broadcast", lambda: {**base, "up": torch.randn(1, 8)}),
                BadInput("up_dtype", lambda: {**base, "up": torch.randn(4, 8, dtype=torch.float64)}),
                BadInput("up_device", lambda: {**base, "up": torch.randn(4, 8, device="meta")}),
                BadInput("int_up", lambda: {**base, "up": torch.ones(4, 8, dtype=torch.int32)}),
            ]
        if has_approximate:
            out += [
                BadInput("approximate_unknown", lambda: {**base, "approximate": "erf"}),
                BadInput("approximate_none_object", lambda: {**base, "approximate": None}),
            ]
        return out
    return bad


def _elementwise(inputs: tuple[str, ...]) -> Sharding:
    """Any dimension sharded, the same in every input and the output."""
    return lambda a: each_dim(range(a[inputs[0]].ndim), ("y",), inputs)


GELU = KernelSpec(
    name="gelu",
    signature=gelu,
    validate=validate_gelu,
    forward=gelu_fwd,
    backward=gelu_bwd,
    outputs=("y",),
    differentiable=("x",),
    # tanh form: x³ (2), multiply-add (2), scale, tanh, add, two multiplies
    flops=_per_element(9.0, "x"),
    cases=_cases(_make_x(approximate="none"), gated=False,
                 alternative=("tanh", _make_x(approximate="tanh"))),
    bad_inputs=_bad_inputs("gelu"),
    sharding=_elementwise(("x",)),
    memory_bound=True,
)

SILU = KernelSpec(
    name="silu",
    signature=silu,
    validate=validate_silu,
    forward=silu_fwd,
    backward=silu_bwd,
    outputs=("y",),
    differentiable=("x",),
    # exp, add, divide, multiply
    flops=_per_element(4.0, "x"),
    cases=_cases(_make_x(), gated=False),
    bad_inputs=_bad_inputs("silu"),
    sharding=_elementwise(("x",)),
    memory_bound=True,
)

SWIGLU = KernelSpec(
    name="swiglu",
    signature=swiglu,
    validate=validate_swiglu,
    forward=swiglu_fwd,
    backward=swiglu_bwd,
    outputs=("y",),
    differentiable=("gate", "up"),
    flops=_per_element(5.0, "gate"),
    cases=_cases(_make_gated(), gated=True),
    bad_inputs=_bad_inputs("swiglu"),
    sharding=_elementwise(("gate", "up")),
    memory_bound=True,
    peers=("liger", "flag_gems"),
)

GEGLU = KernelSpec(
    name="geglu",
    signature=geglu,
    validate=validate_geglu,
    forward=geglu_fwd,
    backward=geglu_bwd,
    outputs=("y",),
    differentiable=("gate", "up"),
    flops=_per_element(10.0, "gate"),
    cases=_cases(_make_gated(approximate="tanh"), gated=True,
                 alternative=("none", _make_gated(approximate="none"))),
    bad_inputs=_bad_inputs("geglu"),
    sharding=_elementwise(("gate", "up")),
    memory_bound=True,
    peers=("liger",),
)

SPECS = (GELU, SILU, SWIGLU, GEGLU)
