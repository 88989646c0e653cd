"""Numerically stable softmax along one dimension: ``softmax``.

Forward, per row of ``D`` elements along ``dim`` (float32 inside)::

    m = max(x)
    y = exp(x − m) / Σ exp(x − m)

A row held in one chunk is read once and exponentiated once; a longer row keeps a running maximum and rescales its
running sum whenever the maximum grows (``s ← s · exp(m − m') + Σ exp(x − m')``), then is read
again to write ``y``. Backward::

    dx = y · (dy − Σ dy · y)

Any ``dim`` is handled in place: the tensor is seen as ``[outer, D, inner]`` and row ``r`` is
``(r // inner, :, r % inner)``; for the last dimension ``inner`` is 1 and the indexing folds away.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import cached_launch
from .tiling import cdiv, row_tiling, store_output, warps


@triton.jit
def _pointers(BASE, rows, cols, inner, stride_o, stride_d, stride_i):
    """Pointers to ``rows × cols`` of an ``[outer, D, inner]`` tensor (``rows`` int64): one 64-bit
    base per row plus 32-bit column offsets (no 64-bit arithmetic per element)."""
    row_base = BASE + (rows // inner) * stride_o + (rows % inner) * stride_i
    return row_base[:, None] + (cols * stride_d)[None, :]


@cached_launch
@triton.jit
def _softmax_fwd_kernel(
    X, Y,
    R, D, inner,  # rows (outer · inner), softmax length, inner size; Y is contiguous
    stride_xo, stride_xd, stride_xi,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # D <= BLOCK_D: the exponentials of pass 1 are the ones pass 2 needs
    STREAM: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)

    # Pass 1: running maximum and sum; the first chunk stays in registers.
    mask0 = row_ok[:, None] & (cols < D)[None, :]
    x0 = tl.load(_pointers(X, rows, cols, inner, stride_xo, stride_xd, stride_xi), mask=mask0,
                 other=-float("inf")).to(tl.float32)
    m = tl.max(x0, axis=1)
    e0 = tl.exp(x0 - m[:, None])
    # while a row's elements so far are all −inf (a masked head) there is nothing to sum, and
    # exp(−inf − (−inf)) would be NaN; a row that is −inf throughout still ends NaN (0 · inf), as 0/0
    s = tl.where(m == -float("inf"), 0.0, tl.sum(e0, axis=1))
    for c in range(BLOCK_D, D, BLOCK_D):
        mask = row_ok[:, None] & (c + cols < D)[None, :]
        x = tl.load(_pointers(X, rows, c + cols, inner, stride_xo, stride_xd, stride_xi), mask=mask,
                    other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = tl.where(m_new == -float("inf"), 0.0,
                     s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1))
        m = m_new
    inv = 1.0 / s

    # Pass 2: write y.
    for c in range(0, D, BLOCK_D):
        mask = row_ok[:, None] & (c + cols < D)[None, :]
        if ONE_CHUNK:
            e = e0
        elif c == 0:
            e = tl.exp(x0 - m[:, None])
        else:
            x = tl.load(_pointers(X, rows, c + cols, inner, stride_xo, stride_xd, stride_xi), mask=mask,
                        other=-float("inf")).to(tl.float32)
            e = tl.exp(x - m[:, None])
        y = e * inv[:, None]
        y_ptrs = _pointers(Y, rows, c + cols, inner, D * inner, inner, 1)
        store_output(y_ptrs, y.to(Y.dtype.element_ty), mask, STREAM)


@cached_launch
@triton.jit
def _softmax_bwd_kernel(
    Y, DY, DX,
    R, D, inner,  # as in the forward; DX is contiguous
    stride_yo, stride_yd, stride_yi, stride_dyo, stride_dyd, stride_dyi,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)

    # Pass 1: Σ dy · y; the first chunk stays in registers.
    mask0 = row_ok[:, None] & (cols < D)[None, :]
    y0 = tl.load(_pointers(Y, rows, cols, inner, stride_yo, stride_yd, stride_yi), mask=mask0,
                 other=0.0).to(tl.float32)
    dy0 = tl.load(_pointers(DY, rows, cols, inner, stride_dyo, stride_dyd, stride_dyi), mask=mask0,
                  other=0.0).to(tl.float32)
    dot = tl.sum(dy0 * y0, axis=1)
    for c in range(BLOCK_D, D, BLOCK_D):
        mask = row_ok[:, None] & (c + cols < D)[None, :]
        y = tl.load(_pointers(Y, rows, c + cols, inner, stride_yo, stride_yd, stride_yi), mask=mask,
                    other=0.0).to(tl.float32)
        dy = tl.load(_pointers(DY, rows, c + cols, inner, stride_dyo, stride_dyd, stride_dyi), mask=mask,
                     other=0.0).to(tl.float32)
        dot += tl.sum(dy * y, axis=1)

    # Pass 2: write dx.
    for c in range(0, D, BLOCK_D):
        mask = row_ok[:, None] & (c + cols < D)[None, :]
        if c == 0:
            y, dy = y0, dy0
        else:
            y = tl.load(_pointers(Y, rows, c + cols, inner, stride_yo, stride_yd, stride_yi), mask=mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(_pointers(DY, rows, c + cols, inner, stride_dyo, stride_dyd, stride_dyi), mask=mask,
                         other=0.0).to(tl.float32)
        dx = y * (dy - dot[:, None])
        dx_ptrs = _pointers(DX, rows, c + cols, inner, D * inner, inner, 1)
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[outer, D, inner]`` around ``dim`` (a view when the layout allows one)."""
    return t.reshape(math.prod(t.shape[:dim]), t.shape[dim], math.prod(t.shape[dim + 1:]))


def softmax_fwd(x, dim, *, max_block: int = 16384, chunk: int = 16384, tile_elems: int = 2048,
                elems_per_warp: int = 512, stream: bool = False) -> tuple[torch.Tensor]:
    """``(y,)``. Tuning: rows up to ``max_block`` long are read once, longer ones twice in chunks
    of ``chunk`` columns; each program handles about ``tile_elems`` elements with one warp per
    ``elems_per_warp``; ``stream`` writes ``y`` as streamed data (see `kpt_triton.tiling.store_output`)."""
    x3 = _as_3d(x, dim)
    outer, d, inner = x3.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_r, block_d = row_tiling(d, max_block=max_block, tile_elems=tile_elems, chunk=chunk)
    n_rows = outer * inner
    if n_rows and d:
        _softmax_fwd_kernel[(cdiv(n_rows, block_r),)](
            x3, y, n_rows, d, inner, *x3.stride(),
            BLOCK_R=block_r, BLOCK_D=block_d, ONE_CHUNK=d <= block_d, STREAM=stream,
            num_warps=warps(block_r * block_d, elems_per_warp),
        )
    return (y,)


def softmax_bwd(x, dim, y, dy, *, max_block: int = 16384, chunk: int = 16384, tile_elems: int = 2048,
                elems_per_warp: int = 512) -> tuple[torch.Tensor]:
    """``(dx,)`` from the saved output ``y``; tuning as `softmax_fwd`."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y3, dy3 = _as_3d(y, dim), _as_3d(dy, dim)
    outer, d, inner = y3.shape
    block_r, block_d = row_tiling(d, max_block=max_block, tile_elems=tile_elems, chunk=chunk)
    n_rows = outer * inner
    if n_rows and d:
        _softmax_bwd_kernel[(cdiv(n_rows, block_r),)](
            y3, dy3, dx, n_rows, d, inner, *y3.stride(), *dy3.stride(),
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps(block_r * block_d, elems_per_warp),
        )
    return (dx,)
