"""``grouped_linear`` through torch's GEMM (oneDNN on an Intel GPU): one matmul per expert.

    y[r] = x_sorted[r] @ weight[e].T     for bounds[e] <= r < bounds[e+1]; other rows 0
    dx[r] = dy[r] @ weight[e],  dweight[e] = dy[rows of e].T @ x_sorted[rows of e]

``bounds`` are the offsets as the contract reads them (`kpt.kernels.moe.expert_bounds`: clamped
to the rows, non-decreasing), read on the host once per call: a device synchronization, and
such a call cannot be captured in a graph. The rest of the MoE family is kpt-triton's.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from kpt.kernels.moe import expert_bounds


def _experts(offsets: torch.Tensor, rows: int) -> list[tuple[int, int, int]]:
    """``(expert, first row, end row)`` of each expert that has rows."""
    bounds = expert_bounds(offsets, rows).tolist()
    return [(e, lo, hi) for e, (lo, hi) in enumerate(pairwise(bounds)) if hi > lo]


def grouped_linear_fwd(x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    y = x_sorted.new_zeros(x_sorted.shape[0], weight.shape[1])
    for e, lo, hi in _experts(offsets, x_sorted.shape[0]):
        torch.mm(x_sorted[lo:hi], weight[e].t(), out=y[lo:hi])
    return (y,)


def grouped_linear_bwd(x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
                       dy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    dx = x_sorted.new_zeros(x_sorted.shape)
    dweight = weight.new_zeros(weight.shape)
    if dy is not None:
        for e, lo, hi in _experts(offsets, x_sorted.shape[0]):
            torch.mm(dy[lo:hi], weight[e], out=dx[lo:hi])
            torch.mm(dy[lo:hi].t(), x_sorted[lo:hi], out=dweight[e])
    return dx, dweight
