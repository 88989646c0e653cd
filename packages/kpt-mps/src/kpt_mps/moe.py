"""Mixture-of-experts bodies (``shaders/moe.metal``); ``grouped_linear`` multiplies each expert's
block of rows with torch's matmul (MPS's on a Mac), in float32."""

from __future__ import annotations

import torch

from kpt.kernels.moe import expert_bounds

from . import metal


def _threads(n):
    return -(-n // metal.ROW_THREADS) * metal.ROW_THREADS


def _row_of_pair(order):
    rows = torch.empty_like(order)
    metal.launch("moe", "moe_row_of_pair", [order, rows, metal.ints(order.numel(), like=order)],
                 _threads(order.numel()), metal.ROW_THREADS)
    return rows


def moe_gating_fwd(logits, k, renormalize):
    z = logits.contiguous()
    tokens, experts = z.shape
    weights = torch.empty(tokens, k, dtype=torch.float32, device=z.device)
    indices = torch.empty(tokens, k, dtype=torch.int32, device=z.device)
    metal.rows("moe", "moe_gating_fwd",
               [z, weights, indices, metal.ints(experts, k, metal.code(z), renormalize, like=z)], tokens)
    return weights, indices


def moe_gating_bwd(logits, k, renormalize, weights, indices, dweights, dindices):
    if dweights is None:
        return (torch.zeros_like(logits, memory_format=torch.contiguous_format),)
    z = logits.contiguous()
    dz = torch.empty_like(z)
    metal.rows("moe", "moe_gating_bwd",
               [z, weights.contiguous(), indices.contiguous(), dweights.float().contiguous(), dz,
                metal.ints(z.shape[1], k, metal.code(z), renormalize, like=z)], z.shape[0])
    return (dz,)


def moe_dispatch_fwd(x, indices, num_experts):
    flat = indices.contiguous().reshape(-1)
    pairs, k, hidden = flat.numel(), indices.shape[1], x.shape[1]
    order = torch.empty(pairs, dtype=torch.int32, device=x.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=x.device)
    metal.launch("moe", "moe_dispatch_order", [flat, order, metal.ints(pairs, num_experts, like=x)],
                 _threads(pairs), metal.ROW_THREADS)
    metal.launch("moe", "moe_dispatch_offsets", [flat, offsets, metal.ints(pairs, num_experts, like=x)],
                 _threads(num_experts + 1), metal.ROW_THREADS)
    x_sorted = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    metal.elements("moe", "moe_gather",
                   [x.contiguous(), order, x_sorted, metal.ints(x_sorted.numel(), hidden, k, metal.code(x), like=x)],
                   x_sorted.numel())
    return x_sorted, offsets, order


def moe_dispatch_bwd(x, indices, num_experts, x_sorted, offsets, order, dx_sorted, doffsets, dorder):
    if dx_sorted is None:
        return (torch.zeros_like(x, memory_format=torch.contiguous_format),)
    tokens, k = indices.shape
    dx = torch.empty(tokens, x.shape[1], dtype=x.dtype, device=x.device)
    metal.elements("moe", "moe_combine_fwd",
                   [dx_sorted.contiguous(), _row_of_pair(order), metal.buffer(None, x), dx,
                    metal.ints(dx.numel(), x.shape[1], k, metal.code(x), -1, like=x)], dx.numel())
    return (dx,)


def _blocks(offsets, rows):
    """Each expert's row range, read on the host (the clamped, non-decreasing offsets)."""
    bounds = expert_bounds(offsets, rows).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def grouped_linear_fwd(x_sorted, offsets, weight):
    x32, w32 = x_sorted.float(), weight.float()
    y = torch.zeros(x_sorted.shape[0], weight.shape[1], dtype=torch.float32, device=x_sorted.device)
    for e, (lo, hi) in enumerate(_blocks(offsets, x_sorted.shape[0])):
        if hi > lo:
            y[lo:hi] = x32[lo:hi] @ w32[e].T
    return (y.to(x_sorted.dtype),)


def grouped_linear_bwd(x_sorted, offsets, weight, y, dy):
    x32, w32 = x_sorted.float(), weight.float()
    dx = torch.zeros(x32.shape, dtype=torch.float32, device=x32.device)
    dw = torch.zeros(w32.shape, dtype=torch.float32, device=x32.device)
    if dy is not None:
        g = dy.float()
        for e, (lo, hi) in enumerate(_blocks(offsets, x32.shape[0])):
            if hi > lo:
                dx[lo:hi] = g[lo:hi] @ w32[e]
                dw[e] = g[lo:hi].T @ x32[lo:hi]
    return dx.to(x_sorted.dtype), dw.to(weight.dtype)


def moe_combine_fwd(y_sorted, order, weights):
    tokens, k = weights.shape
    y = torch.empty(tokens, y_sorted.shape[1], dtype=y_sorted.dtype, device=y_sorted.device)
    metal.elements("moe", "moe_combine_fwd",
                   [y_sorted.contiguous(), _row_of_pair(order.contiguous()), weights.contiguous(), y,
                    metal.ints(y.numel(), y.shape[1], k, metal.code(y), metal.code(weights), like=y)], y.numel())
    return (y,)


def moe_combine_bwd(y_sorted, order, weights, y, dy):
    if dy is None:
        return (torch.zeros_like(y_sorted, memory_format=torch.contiguous_format),
                torch.zeros_like(weights, memory_format=torch.contiguous_format))
    tokens, k = weights.shape
    pairs, hidden = y_sorted.shape
    order, w, dy = order.contiguous(), weights.contiguous(), dy.contiguous()
    rows = _row_of_pair(order)
    dweights = torch.empty(tokens, k, dtype=weights.dtype, device=weights.device)
    metal.launch("moe", "moe_combine_dweights",
                 [y_sorted.contiguous(), rows, dy, dweights,
                  metal.ints(pairs, hidden, k, metal.code(y_sorted), metal.code(weights), like=y_sorted)],
                 _threads(pairs), metal.ROW_THREADS)
    dy_sorted = torch.empty(pairs, hidden, dtype=y_sorted.dtype, device=y_sorted.device)
    metal.elements("moe", "moe_combine_dy_sorted",
                   [order, rows, w, dy, dy_sorted,
                    metal.ints(dy_sorted.numel(), hidden, k, pairs, metal.code(y_sorted), metal.code(weights),
                               like=y_sorted)], dy_sorted.numel())
    return dy_sorted, dweights
