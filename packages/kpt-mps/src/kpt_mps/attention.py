"""Attention bodies (``shaders/attention.metal``): the forward (one simdgroup per block of 8
queries, 8×8 simdgroup_matrix products) with its log-sum-exp, then the backward in two dispatches
(dq with the row statistic delta, then dk and dv)."""

from __future__ import annotations

import torch

from . import metal


def _params(q, k, causal, scale):
    b, hq, sq, d = q.shape
    return (metal.ints(b, hq, k.shape[1], sq, k.shape[2], d, causal, metal.code(q), like=q),
            metal.floats(scale, like=q))


def _threads(n):
    return -(-n // metal.ROW_THREADS) * metal.ROW_THREADS


def attention_fwd(q, k, v, causal, scale):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    blocks = q.shape[0] * q.shape[1] * -(-q.shape[2] // 8)
    metal.launch("attention", "attention_fwd", [q, k, v, o, lse, *_params(q, k, causal, scale)], blocks * 32, 32)
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
                 _threads(lse.numel()), metal.ROW_THREADS)
    metal.launch("attention", "attention_bwd_dkv", [q, k, v, lse.contiguous(), do, delta, dk, dv, *params],
                 _threads(k.shape[0] * k.shape[1] * k.shape[2]), metal.ROW_THREADS)
    return dq, dk, dv
