"""Gated activations: ``swiglu`` forward and backward; ``silu`` forward only (its backward is not
written yet, so the backend lacks it)."""

from __future__ import annotations

import torch


def silu_fwd(x):
    xf = x.float()
    return ((xf * torch.sigmoid(xf)).to(x.dtype).contiguous(),)


def swiglu_fwd(gate, up):
    g = gate.float()
    return ((g * torch.sigmoid(g) * up.float()).to(gate.dtype).contiguous(),)


def swiglu_bwd(gate, up, y, dy):
    g, u, d = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    dgate = d * u * s * (1 + g * (1 - s))
    return dgate.to(gate.dtype).contiguous(), (d * g * s).to(up.dtype).contiguous()
