"""RMS normalization bodies (``shaders/rms_norm.metal``): ``rms_norm`` and ``add_rms_norm``."""

from __future__ import annotations

import torch

from kpt.spec import rows as flat

from . import metal


def _forward(x, residual, weight, eps):
    x2 = flat(x).contiguous()
    n, d = x2.shape
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else None
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    res = flat(residual) if residual is not None else None
    metal.rows("rms_norm", "rms_norm_fwd",
               [x2, metal.buffer(res, x), metal.buffer(weight, x), y, metal.buffer(h, x), rstd,
                metal.ints(d, metal.code(x), metal.code(weight), metal.code(res), like=x),
                metal.floats(eps, like=x)], n)
    return y.reshape(x.shape), (h.reshape(x.shape) if h is not None else None), rstd


def _backward(h, weight, rstd, dy, dh):
    h2 = flat(h).contiguous()
    n, d = h2.shape
    dy2 = flat(dy).contiguous() if dy is not None else torch.zeros_like(h2)
    dx = torch.empty_like(h2)
    metal.rows("rms_norm", "rms_norm_bwd",
               [h2, metal.buffer(weight, h), dy2, metal.buffer(flat(dh) if dh is not None else None, h), rstd, dx,
                metal.ints(d, metal.code(h), metal.code(weight), metal.code(dh), like=h)], n)
    if weight is None:
        return dx.reshape(h.shape), h.new_empty(0)
    dw = torch.empty(d, dtype=weight.dtype, device=h.device)
    metal.launch("rms_norm", "rms_norm_dweight",
                 [h2, dy2, rstd, dw, metal.ints(n, d, metal.code(h), metal.code(weight), like=h)],
                 -(-d // metal.ROW_THREADS) * metal.ROW_THREADS, metal.ROW_THREADS)
    return dx.reshape(h.shape), dw


def rms_norm_fwd(x, weight, eps):
    y, _, rstd = _forward(x, None, weight, eps)
    return y, rstd


def rms_norm_bwd(x, weight, eps, y, rstd, dy):
    return _backward(x, weight, rstd, dy, None)


def add_rms_norm_fwd(x, residual, weight, eps):
    return _forward(x, residual, weight, eps)


def add_rms_norm_bwd(x, residual, weight, eps, y, h, rstd, dy, dh):
    return _backward(h, weight, rstd, dy, dh)
