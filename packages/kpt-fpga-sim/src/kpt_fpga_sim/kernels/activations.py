"""Pointwise activations and gated units as HLS designs: ``gelu``, ``silu``, ``swiglu``, ``geglu``.

One pipelined loop over the elements, U lanes (matched to the off-chip bandwidth), II = reuse:

    for j in 0..n step U  PIPELINE II=reuse, UNROLL U
        y[j] = act(x[j])                       (gated: y[j] = act(gate[j]) · up[j])

    gelu   = ½ x · erfc(−x/√2)                           erf unit
    gelu~  = ½ x · (1 + tanh(√(2/π) (x + 0.044715 x³)))  tanh unit
    silu   = x · σ(x)                                    sigmoid unit

In fixed point the units are interpolated tables (`kpt_fpga_sim.nonlinear`); the derivatives
reuse them: gelu' = Φ(x) + x·φ(x) (φ from the exp unit), silu' = σ · (1 + x · (1 − σ)).
"""

from __future__ import annotations

import math

from ..hls import Design
from ..sim import Call, current, flops, stream

_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_CUBIC = 0.044715


def _tanh_arg(a, x):
    return a.const(_SQRT_2_OVER_PI) * (x + a.const(_CUBIC) * x * x * x)


def gelu_value(a, x, approximate):
    """gelu of a loaded value ``x`` (full width; the caller declares the result type)."""
    if approximate == "tanh":
        return a.const(0.5) * x * (a.const(1.0) + a.tanh(_tanh_arg(a, x)))
    return a.const(0.5) * x * a.erfc(a.const(-_SQRT_HALF) * x)


def gelu_grad(a, x, approximate):
    if approximate == "tanh":
        t = a.tanh(_tanh_arg(a, x))
        inner = a.const(_SQRT_2_OVER_PI) * (a.const(1.0) + a.const(3 * _CUBIC) * x * x)
        return a.const(0.5) * (a.const(1.0) + t) + a.const(0.5) * x * (a.const(1.0) - t * t) * inner
    cdf = a.const(0.5) * a.erfc(a.const(-_SQRT_HALF) * x)
    return cdf + x * a.exp(a.const(-0.5) * x * x) * a.const(_INV_SQRT_2PI)


def silu_value(a, x):
    return x * a.sigmoid(x)


def silu_grad(a, x):
    s = a.sigmoid(x)
    return s * (a.const(1.0) + x * (a.const(1.0) - s))


def _pointwise(t, name, fn):
    a = current().arith
    return a.out(a.cast(fn(a, a.load(t, name)), "y"), t.dtype).reshape(t.shape)


def gelu_fwd(x, approximate):
    return _pointwise(x, "x", lambda a, v: gelu_value(a, v, approximate))


def gelu_bwd(x, approximate, y, dy):
    a = current().arith
    grad = gelu_grad(a, a.load(x, "x"), approximate)
    return a.out(a.cast(a.load(dy, "dy") * grad, "dx"), x.dtype).reshape(x.shape)


def silu_fwd(x):
    return _pointwise(x, "x", silu_value)


def silu_bwd(x, y, dy):
    a = current().arith
    grad = silu_grad(a, a.load(x, "x"))
    return a.out(a.cast(a.load(dy, "dy") * grad, "dx"), x.dtype).reshape(x.shape)


def _gated_fwd(gate, up, act):
    a = current().arith
    y = act(a, a.load(gate, "gate")) * a.load(up, "up")
    return a.out(a.cast(y, "y"), gate.dtype).reshape(gate.shape)


def _gated_bwd(gate, up, dy, act, grad):
    a = current().arith
    g, u, d = a.load(gate, "gate"), a.load(up, "up"), a.load(dy, "dy")
    dgate = a.cast(a.cast(d * u, "dy·up", a.wide) * grad(a, g), "dgate")
    dup = a.cast(d * act(a, g), "dup")
    return a.out(dgate, gate.dtype).reshape(gate.shape), a.out(dup, up.dtype).reshape(up.shape)


def swiglu_fwd(gate, up):
    return _gated_fwd(gate, up, silu_value)


def swiglu_bwd(gate, up, y, dy):
    return _gated_bwd(gate, up, dy, silu_value, silu_grad)


def geglu_fwd(gate, up, approximate):
    return _gated_fwd(gate, up, lambda a, v: gelu_value(a, v, approximate))


def geglu_bwd(gate, up, approximate, y, dy):
    return _gated_bwd(gate, up, dy, lambda a, v: gelu_value(a, v, approximate),
                      lambda a, v: gelu_grad(a, v, approximate))


# -- designs: one pipelined loop each; ops per element, the function unit on the chain --------

_GELU = {"none": ({"mul": 3, "add": 1, "erf": 1}, ("mul", "erf", "add", "mul", "mul")),
         "tanh": ({"mul": 6, "add": 2, "tanh": 1}, ("mul", "mul", "add", "mul", "tanh", "add", "mul", "mul"))}
_GELU_GRAD = {"none": ({"mul": 6, "add": 2, "erf": 1, "exp": 1}, ("mul", "mul", "exp", "mul", "add", "mul")),
              "tanh": ({"mul": 10, "add": 5, "tanh": 1},
                       ("mul", "mul", "add", "mul", "tanh", "mul", "add", "mul", "add", "mul"))}
_SILU = ({"mul": 1, "sigmoid": 1}, ("sigmoid", "mul"))
_SILU_GRAD = ({"mul": 3, "add": 2, "sigmoid": 1}, ("sigmoid", "add", "mul", "add", "mul"))


def _elementwise(call: Call, kernel: str, n: int, traffic: int, ops, chain, work: float) -> Design:
    loop = stream(call, kernel, n, call.lanes(traffic / max(n, 1)), ops, chain)
    return Design(kernel, loop, (), traffic, work)


def _with(ops, extra: int):
    """``ops`` plus ``extra`` multiplies (the activation's own product, the gating, the upstream
    gradient)."""
    return {**ops, "mul": ops.get("mul", 0) + extra}


def gelu_design(call: Call, x, approximate):
    ops, chain = _GELU[approximate]
    return _elementwise(call, "gelu", x.numel(), call.io_bytes(x, x), ops, chain,
                        flops("gelu", (x, approximate)))


def gelu_bwd_design(call: Call, x, approximate, *outputs_and_grads):
    ops, chain = _GELU_GRAD[approximate]
    return _elementwise(call, "gelu", x.numel(), call.io_bytes(x, x, x), _with(ops, 1), (*chain, "mul"),
                        flops("gelu", (x, approximate), 2.0))


def silu_design(call: Call, x):
    return _elementwise(call, "silu", x.numel(), call.io_bytes(x, x), *_SILU, flops("silu", (x,)))


def silu_bwd_design(call: Call, x, *outputs_and_grads):
    ops, chain = _SILU_GRAD
    return _elementwise(call, "silu", x.numel(), call.io_bytes(x, x, x), _with(ops, 1), (*chain, "mul"),
                        flops("silu", (x,), 2.0))


def swiglu_design(call: Call, gate, up):
    ops, chain = _SILU
    return _elementwise(call, "swiglu", gate.numel(), call.io_bytes(gate, up, gate), _with(ops, 1),
                        (*chain, "mul"), flops("swiglu", (gate, up)))


def swiglu_bwd_design(call: Call, gate, up, *outputs_and_grads):
    ops, chain = _SILU_GRAD
    return _elementwise(call, "swiglu", gate.numel(), call.io_bytes(gate, up, gate, gate, up),
                        _with(ops, 4), (*chain, "mul", "mul"),
                        flops("swiglu", (gate, up), 2.0))


def geglu_design(call: Call, gate, up, approximate):
    ops, chain = _GELU[approximate]
    return _elementwise(call, "geglu", gate.numel(), call.io_bytes(gate, up, gate), _with(ops, 1),
                        (*chain, "mul"), flops("geglu", (gate, up, approximate)))


def geglu_bwd_design(call: Call, gate, up, approximate, *outputs_and_grads):
    ops, chain = _GELU_GRAD[approximate]
    value, _ = _GELU[approximate]
    merged = {k: ops.get(k, 0) + value.get(k, 0) for k in {*ops, *value}}
    return _elementwise(call, "geglu", gate.numel(), call.io_bytes(gate, up, gate, gate, up),
                        _with(merged, 3), (*chain, "mul", "mul"),
                        flops("geglu", (gate, up, approximate), 2.0))
