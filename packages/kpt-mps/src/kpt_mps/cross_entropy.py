"""Cross-entropy bodies (``shaders/cross_entropy.metal``): ``cross_entropy`` and
``linear_cross_entropy``, whose logits come chunk by chunk from torch's matmul (the MPS one on a
Mac) and go through the same row kernel."""

from __future__ import annotations

import torch

from . import metal

CHUNK_ELEMENTS = 1 << 24
"""Logits of `linear_cross_entropy` held at once (rows per chunk = this // V)."""


def _kept(target, ignore_index):
    return (target != ignore_index).sum().clamp(min=1)


def _unit(target, ignore_index, reduction, dloss=None):
    """The gradient reaching each row's loss (float32 [N]): 0 on ignored rows."""
    g = torch.ones((), dtype=torch.float32, device=target.device) if dloss is None else dloss.float()
    if reduction == "mean":
        g = g / _kept(target, ignore_index)
    return torch.where(target != ignore_index, g, 0.0).expand(target.shape).contiguous()


def _rows(z, target, unit, ignore_index, label_smoothing, grad, grad_dtype):
    """(per-row losses, lse, dz or None) of logits ``z`` [n, V]."""
    n, v = z.shape
    losses = torch.empty(n, dtype=torch.float32, device=z.device)
    lse = torch.empty_like(losses)
    dz = torch.empty(z.shape, dtype=grad_dtype, device=z.device) if grad else None
    metal.rows("cross_entropy", "cross_entropy_fwd",
               [z.contiguous(), target.contiguous(), unit, losses, lse, metal.buffer(dz, z),
                metal.ints(v, metal.code(z), ignore_index, grad, metal.code(dz), like=z),
                metal.floats(label_smoothing, like=z)], n)
    return losses, lse, dz


def _reduce(losses, target, ignore_index, reduction, dtype):
    if reduction == "none":
        return losses.to(dtype)
    total = losses.sum()
    return (total if reduction == "sum" else total / _kept(target, ignore_index)).to(dtype)


def _scaled(d, g, per_row):
    out = torch.empty_like(d)
    metal.elements("cross_entropy", "scale_rows",
                   [d.contiguous(), g.float().contiguous(), out,
                    metal.ints(d.numel(), d.shape[-1] if d.dim() else 1, metal.code(d), per_row, like=d)], d.numel())
    return out


def cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad):
    unit = _unit(target, ignore_index, reduction)
    losses, _, dz = _rows(logits, target, unit, ignore_index, label_smoothing, needs_grad, logits.dtype)
    loss = _reduce(losses, target, ignore_index, reduction, torch.float32)
    return loss, dz if dz is not None else logits.new_empty(0)


def cross_entropy_bwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad, loss, dlogits, dloss):
    if dloss is None:
        return (torch.zeros_like(dlogits),)
    return (_scaled(dlogits, dloss.reshape(-1), reduction == "none"),)


def _chunks(hidden, weight, bias, target, ignore_index, unit):
    """Losses, lse and (with ``unit``) the float32 gradients, one chunk of logits at a time."""
    h32, w32 = hidden.float(), weight.float()
    step = max(1, CHUNK_ELEMENTS // max(weight.shape[0], 1))
    losses, lses, dhs = [], [], []
    dw = torch.zeros(w32.shape, dtype=torch.float32, device=hidden.device)
    db = torch.zeros(w32.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, max(hidden.shape[0], 1), step):
        r = slice(start, start + step)
        z = h32[r] @ w32.T
        if bias is not None:
            z = z + bias.float()
        loss, lse, dz = _rows(z, target[r], unit[r] if unit is not None else _unit(target[r], ignore_index, "sum"),
                              ignore_index, 0.0, unit is not None, torch.float32)
        losses.append(loss)
        lses.append(lse)
        if dz is not None:
            # an ignored row adds nothing, also where its hidden state or a weight holds inf or NaN
            ignored = (target[r] == ignore_index)[:, None]
            dhs.append((dz @ w32).masked_fill_(ignored, 0.0))
            dw += dz.T @ h32[r].masked_fill(ignored, 0.0)
            db += dz.sum(0)
    grads = (torch.cat(dhs), dw, db) if unit is not None else None
    return torch.cat(losses), torch.cat(lses), grads


def _grads_out(hidden, weight, bias, dh, dw, db):
    return dh.to(hidden.dtype), dw.to(weight.dtype), db.to(bias.dtype) if bias is not None else db.new_empty(0)


def linear_cross_entropy_fwd(hidden, weight, target, bias, ignore_index, reduction, needs_grad):
    fused = needs_grad and reduction != "none"
    unit = _unit(target, ignore_index, reduction) if fused else None
    losses, lse, grads = _chunks(hidden, weight, bias, target, ignore_index, unit)
    loss = _reduce(losses, target, ignore_index, reduction, torch.float32)
    empty = hidden.new_empty(0)
    return (loss, *(_grads_out(hidden, weight, bias, *grads) if grads is not None else (empty, empty, empty)), lse)


def linear_cross_entropy_bwd(hidden, weight, target, bias, ignore_index, reduction, needs_grad, loss,
                             dhidden, dweight, dbias, lse, dloss):
    if needs_grad and reduction != "none":
        g = dloss.float().reshape(1)
        return (_scaled(dhidden, g, False), _scaled(dweight, g, False),
                _scaled(dbias, g, False) if bias is not None else dbias)
    unit = _unit(target, ignore_index, reduction, dloss)
    _, _, grads = _chunks(hidden, weight, bias, target, ignore_index, unit)
    return _grads_out(hidden, weight, bias, *grads)
