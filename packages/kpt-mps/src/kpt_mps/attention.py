"""Attention bodies (``shaders/attention.metal``), tiled with 8×8 simdgroup_matrix products: the
forward (one simdgroup per block of 8 queries, an online softmax) with its log-sum-exp, then the
backward in two dispatches, each recomputing the probabilities from the log-sum-exp: dq (one
simdgroup per block of 8 queries; it also writes the row statistic delta = rowsum(dO ⊙ O)), then dk
and dv (one simdgroup per block of 8 keys, over the queries of every head of its key/value head's
group)."""

from __future__ import annotations

import torch

from . import metal


def _params(q, k, causal, scale):
    b, hq, sq, d = q.shape
    return (metal.ints(b, hq, k.shape[1], sq, k.shape[2], d, causal, metal.code(q), like=q),
            metal.floats(scale, like=q))


def _simdgroups(*shape):
    """Threads for one simdgroup (32 threads) per block of 8 rows of ``shape = (B, H, S)``."""
    b, h, s = shape
    return b * h * -(-s // 8) * 32


def attention_fwd(q, k, v, causal, scale):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    metal.launch("attention", "attention_fwd", [q, k, v, o, lse, *_params(q, k, causal, scale)],
                 _simdgroups(*q.shape[:3]), 32)
    return o, lse


def attention_bwd(q, k, v, causal, scale, o, lse, do):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if do is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    do = do.contiguous()
    params = _params(q, k, causal, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    metal.launch("attention", "attention_bwd_dq", [q, k, v, o.contiguous(), lse.contiguous(), do, delta, dq, *params],
                 _simdgroups(*q.shape[:3]), 32)
    metal.launch("attention", "attention_bwd_dkv", [q, k, v, lse.contiguous(), do, delta, dk, dv, *params],
                 _simdgroups(*k.shape[:3]), 32)
    return dq, dk, dv
