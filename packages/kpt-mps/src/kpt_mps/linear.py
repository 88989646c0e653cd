"""Linear bodies: the products through torch's matmul (MPS's on a Mac) in float32, bias and
activation in the epilogue kernels of ``shaders/linear.metal``."""

from __future__ import annotations

import torch

from kpt.spec import rows as flat

from . import metal
from .activations import KINDS


def linear_fwd(x, weight, bias, activation):
    acc = (flat(x).float() @ weight.float().T).contiguous()
    shape = (*x.shape[:-1], weight.shape[0])
    y = torch.empty(acc.shape, dtype=x.dtype, device=x.device)
    pre = torch.empty_like(y) if activation is not None else None
    metal.elements("linear", "linear_epilogue",
                   [acc, metal.buffer(bias, x), y, metal.buffer(pre, x),
                    metal.ints(acc.numel(), acc.shape[1], metal.code(x), metal.code(bias), KINDS[activation],
                               activation is not None, like=x)], acc.numel())
    return y.reshape(shape), pre.reshape(shape) if pre is not None else x.new_empty(0)


def linear_bwd(x, weight, bias, activation, y, pre, dy):
    dy2 = flat(dy).contiguous()
    if activation is None:
        dpre = dy2.float()
    else:
        dpre = torch.empty(dy2.shape, dtype=torch.float32, device=x.device)
        metal.elements("linear", "linear_epilogue_bwd",
                       [flat(pre).contiguous(), dy2, dpre,
                        metal.ints(dpre.numel(), metal.code(x), KINDS[activation], like=x)], dpre.numel())
    dx = (dpre @ weight.float()).to(x.dtype).reshape(x.shape)
    dweight = (dpre.T @ flat(x).float()).to(weight.dtype)
    dbias = dpre.sum(0).to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx, dweight, dbias
