"""Softmax bodies (``shaders/softmax.metal``): the softmax dimension is moved last, made
contiguous, and moved back."""

from __future__ import annotations

import torch

from . import metal


def _last(t, dim):
    return t.movedim(dim, -1).contiguous()


def softmax_fwd(x, dim):
    xl = _last(x, dim)
    y = torch.empty_like(xl)
    d = xl.shape[-1]
    n = xl.numel() // d if d else 0
    metal.rows("softmax", "softmax_fwd", [xl, y, metal.ints(d, metal.code(x), like=x)], n)
    return (y.movedim(-1, dim).contiguous(),)


def softmax_bwd(x, dim, y, dy):
    yl, dyl = _last(y, dim), _last(dy, dim)
    dx = torch.empty_like(yl)
    d = yl.shape[-1]
    n = yl.numel() // d if d else 0
    metal.rows("softmax", "softmax_bwd", [yl, dyl, dx, metal.ints(d, metal.code(x), like=x)], n)
    return (dx.movedim(-1, dim).contiguous(),)
