"""Rotary embedding bodies (``shaders/rope.metal``): one dispatch for q, one for k."""

from __future__ import annotations

import torch

from . import metal


def _rotate(t, cos, sin, backward):
    if t is None:
        return None
    tc = t.contiguous()
    out = torch.empty_like(tc)
    b, h, s, d = tc.shape
    metal.elements("rope", "rope",
                   [tc, cos.contiguous(), sin.contiguous(), out,
                    metal.ints(tc.numel(), d, s, h, cos.dim() == 3, metal.code(t), backward, like=t)], tc.numel())
    return out


def rope_fwd(q, k, cos, sin):
    return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)


def rope_bwd(q, k, cos, sin, q_out, k_out, dq_out, dk_out):
    def grad(t, dout):
        if dout is None:
            return torch.zeros_like(t, memory_format=torch.contiguous_format)
        return _rotate(dout, cos, sin, True)

    return grad(q_out, dq_out), grad(k_out, dk_out)  # q, k: None (not saved)
