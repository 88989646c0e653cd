"""Activation bodies (``shaders/activations.metal``): gelu, silu and the gated swiglu, geglu."""

from __future__ import annotations

import torch

from . import metal

KINDS = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}
"""Activation kinds of ``shaders/common.metal`` (also linear's fused epilogue)."""


def _gelu_kind(approximate):
    return KINDS["gelu_tanh" if approximate == "tanh" else "gelu"]


def _fwd(x, up, kind):
    xc = x.contiguous()
    y = torch.empty_like(xc)
    metal.elements("activations", "activation_fwd",
                   [xc, metal.buffer(up, x), y, metal.ints(xc.numel(), metal.code(x), kind, up is not None, like=x)],
                   xc.numel())
    return (y,)


def _bwd(x, up, dy, kind):
    xc = x.contiguous()
    dx = torch.empty_like(xc)
    dup = torch.empty_like(xc) if up is not None else None
    metal.elements("activations", "activation_bwd",
                   [xc, metal.buffer(up, x), dy.contiguous(), dx, metal.buffer(dup, x),
                    metal.ints(xc.numel(), metal.code(x), kind, up is not None, like=x)], xc.numel())
    return (dx,) if up is None else (dx, dup)


def gelu_fwd(x, approximate):
    return _fwd(x, None, _gelu_kind(approximate))


def gelu_bwd(x, approximate, y, dy):
    return _bwd(x, None, dy, _gelu_kind(approximate))


def silu_fwd(x):
    return _fwd(x, None, KINDS["silu"])


def silu_bwd(x, y, dy):
    return _bwd(x, None, dy, KINDS["silu"])


def swiglu_fwd(gate, up):
    return _fwd(gate, up, KINDS["silu"])


def swiglu_bwd(gate, up, y, dy):
    return _bwd(gate, up, dy, KINDS["silu"])


def geglu_fwd(gate, up, approximate):
    return _fwd(gate, up, _gelu_kind(approximate))


def geglu_bwd(gate, up, approximate, y, dy):
    return _bwd(gate, up, dy, _gelu_kind(approximate))
