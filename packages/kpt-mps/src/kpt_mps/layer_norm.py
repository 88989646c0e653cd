"""Layer normalization bodies (``shaders/layer_norm.metal``)."""

from __future__ import annotations

import torch

from kpt.spec import rows as flat

from . import metal


def layer_norm_fwd(x, weight, bias, eps):
    x2 = flat(x).contiguous()
    n, d = x2.shape
    y = torch.empty_like(x2)
    mean = torch.empty(n, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    metal.rows("layer_norm", "layer_norm_fwd",
               [x2, metal.buffer(weight, x), metal.buffer(bias, x), y, mean, rstd,
                metal.ints(d, metal.code(x), metal.code(weight), metal.code(bias), like=x),
                metal.floats(eps, like=x)], n)
    return y.reshape(x.shape), mean, rstd


def layer_norm_bwd(x, weight, bias, eps, y, mean, rstd, dy):
    x2 = flat(x).contiguous()
    n, d = x2.shape
    dy2 = flat(dy).contiguous()
    dx = torch.empty_like(x2)
    metal.rows("layer_norm", "layer_norm_bwd",
               [x2, metal.buffer(weight, x), dy2, mean, rstd, dx,
                metal.ints(d, metal.code(x), metal.code(weight), like=x)], n)
    dw = torch.empty(d, dtype=weight.dtype, device=x.device) if weight is not None else x.new_empty(0)
    db = torch.empty(d, dtype=bias.dtype, device=x.device) if bias is not None else x.new_empty(0)
    if weight is not None or bias is not None:
        metal.launch("layer_norm", "layer_norm_dparams",
                     [x2, dy2, mean, rstd, metal.buffer(dw if weight is not None else None, x),
                      metal.buffer(db if bias is not None else None, x),
                      metal.ints(n, d, metal.code(x), metal.code(weight), metal.code(bias), like=x)],
                     -(-d // metal.ROW_THREADS) * metal.ROW_THREADS, metal.ROW_THREADS)
    return dx.reshape(x.shape), dw, db
