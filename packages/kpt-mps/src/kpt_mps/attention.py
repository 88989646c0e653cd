"""Attention bodies (``shaders/attention.metal``), tiled with 8×8 simdgroup_matrix products: the
forward (one simdgroup per block of 8 queries, an online softmax; with a causal mask after a pass
over v that finds the inf and NaN values of the keys it hides) with its log-sum-exp, then the
backward in two dispatches, each recomputing the probabilities from the log-sum-exp: dq (one
simdgroup per block of 8 queries; it also writes the row statistic delta = rowsum(dO ⊙ O)), then dk
and dv (one simdgroup per block of 8 keys, over the queries of every head of its key/value head's
group). The optional boolean mask is read in place through its strides (`_mask`), by every kernel
where it applies the causal mask."""

from __future__ import annotations

import torch

from . import metal


def _params(q, k, causal, scale, mask):
    b, hq, sq, d = q.shape
    strides = (0, 0, 0, 0) if mask is None else mask.stride()
    return (metal.ints(b, hq, k.shape[1], sq, k.shape[2], d, causal, metal.code(q), mask is not None, *strides,
                       like=q),
            metal.floats(scale, like=q))


def _mask(mask, like):
    """The buffer of the ``[B, Hq, Sq, Skv]`` bool mask, read by the shaders through its strides: the
    span of its storage that the view covers, as bytes, not a copy (the view core passes broadcasts
    with stride 0, so a key-padding mask stays ``[B, 1, 1, Skv]`` in memory); a placeholder without
    a mask (or an empty one, which no thread reads)."""
    if mask is None or mask.numel() == 0:
        return metal.buffer(None, like=like)
    span = 1 + sum((n - 1) * s for n, s in zip(mask.shape, mask.stride()))
    return mask.as_strided((span,), (1,), mask.storage_offset()).view(torch.uint8)


def _simdgroups(*shape):
    """Threads for one simdgroup (32 threads) per block of 8 rows of ``shape = (B, H, S)``."""
    b, h, s = shape
    return b * h * -(-s // 8) * 32


def _last_nonfinite(v):
    """int32 ``[B, Hkv, D]``: per column of each head of ``v``, the last row holding ±inf or NaN (-1 if none)."""
    b, h, s, d = v.shape
    last = torch.empty((b, h, d), dtype=torch.int32, device=v.device)
    params = metal.ints(b * h * d, s, d, metal.code(v), like=v)
    metal.elements("attention", "attention_last_nonfinite", [v, last, params], last.numel())
    return last


def attention_fwd(q, k, v, causal, scale, mask):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    # with a causal mask some keys are hidden from some queries, and the forward never loads them:
    # where their v holds inf or NaN the reference's p · v gives NaN (0 · inf), so the kernel is told
    last = _last_nonfinite(v) if causal and q.shape[2] > 1 else metal.buffer(None, like=q)
    metal.launch("attention", "attention_fwd", [q, k, v, last, _mask(mask, q), o, lse,
                                                *_params(q, k, causal, scale, mask)],
                 _simdgroups(*q.shape[:3]), 32)
    return o, lse


def attention_bwd(q, k, v, causal, scale, mask, o, lse, do):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if do is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    do = do.contiguous()
    params, m = _params(q, k, causal, scale, mask), _mask(mask, q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    metal.launch("attention", "attention_bwd_dq",
                 [q, k, v, o.contiguous(), lse.contiguous(), do, m, delta, dq, *params], _simdgroups(*q.shape[:3]), 32)
    metal.launch("attention", "attention_bwd_dkv", [q, k, v, lse.contiguous(), do, delta, m, dk, dv, *params],
                 _simdgroups(*k.shape[:3]), 32)
    return dq, dk, dv
