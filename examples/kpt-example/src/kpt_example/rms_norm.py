"""RMS normalization, with a bug left in on purpose: ``eps`` is added after the square root.

    rstd = 1 / (sqrt(mean(x², -1)) + eps)      (the contract: rsqrt(mean(x², -1) + eps))
"""

from __future__ import annotations

import math

import torch


def _rows(x):
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()


def rms_norm_fwd(x, weight, eps):
    xr = _rows(x)
    rstd = 1 / (xr.square().sum(-1).div(max(xr.shape[-1], 1)).sqrt() + eps)
    y = xr * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype).reshape(x.shape), rstd


def rms_norm_bwd(x, weight, eps, y, rstd, dy):
    xhat = _rows(x) * rstd[:, None]
    dyr = _rows(dy)
    g = dyr * weight.float() if weight is not None else dyr
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dweight = (dyr * xhat).sum(0).to(weight.dtype) if weight is not None else torch.empty(0, dtype=x.dtype)
    return dx.to(x.dtype).reshape(x.shape), dweight
