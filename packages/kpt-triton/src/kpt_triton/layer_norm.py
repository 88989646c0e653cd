"""Layer normalization over the last dimension: ``layer_norm``.

Forward, per row of ``D`` columns (statistics in float32, biased variance)::

    mean = mean(x, -1)
    rstd = rsqrt(mean((x − mean)², -1) + eps)
    y    = (x − mean) · rstd · weight + bias

Backward, with x̂ = (x − mean) · rstd and g = dy · weight::

    dx      = rstd · (g − mean(g, -1) − x̂ · mean(g · x̂, -1))
    dweight = Σ_rows dy · x̂
    dbias   = Σ_rows dy

The variance is never formed as E[x²] − E[x]² (which cancels when |mean| ≫ std): a row held in
one chunk is centred in registers; a row of several chunks merges each chunk's exact mean and
centred sum of squares (Chan et al.'s pairwise update). The backward runs a persistent grid with
per-program partial sums of ``dweight`` and ``dbias``, reduced by the launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpt.spec import rows

from .launch import cached_launch
from .tiling import (
    cdiv,
    dense_like,
    load_tile,
    load_vector,
    partial_sums,
    persistent_programs,
    row_launch,
    row_tiling,
    store_output,
    total,
    vector,
    warps,
)


@cached_launch
@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,  # W only with HAS_WEIGHT, B only with HAS_BIAS
    R, D,  # rows, columns; Y is contiguous [R, D]
    stride_xr, stride_xc,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # D <= BLOCK_D: the row is normalized straight from the registers
    STREAM: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    # the parameters of the first chunk are requested before the row, so that both loads overlap
    w0 = load_vector(W, cols, D) if HAS_WEIGHT else None
    b0 = load_vector(B, cols, D) if HAS_BIAS else None

    # Statistics of the first chunk, which stays in registers for the output pass.
    mask0 = row_ok[:, None] & (cols < D)[None, :]
    x0 = load_tile(X, rows, cols, stride_xr, stride_xc, mask0)
    count = tl.maximum(tl.minimum(D, BLOCK_D), 1).to(tl.float32)
    mean = tl.sum(x0, axis=1) / count
    centred = tl.where(mask0, x0 - mean[:, None], 0.0)
    m2 = tl.sum(centred * centred, axis=1)
    if not ONE_CHUNK:
        for c in range(BLOCK_D, D, BLOCK_D):
            mask = row_ok[:, None] & (c + cols < D)[None, :]
            x = load_tile(X, rows, c + cols, stride_xr, stride_xc, mask)
            n = tl.minimum(D - c, BLOCK_D).to(tl.float32)
            chunk_mean = tl.sum(x, axis=1) / n
            chunk_centred = tl.where(mask, x - chunk_mean[:, None], 0.0)
            delta = chunk_mean - mean
            total = count + n
            mean += delta * (n / total)
            m2 += tl.sum(chunk_centred * chunk_centred, axis=1) + delta * delta * (count * n / total)
            count = total
    rstd = 1.0 / tl.sqrt(m2 / tl.maximum(D, 1).to(tl.float32) + eps)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)

    y_rows = (Y + rows * D)[:, None]
    if ONE_CHUNK:
        _store_normalized(y_rows, centred, rstd, w0, b0, cols, mask0, HAS_WEIGHT, HAS_BIAS, STREAM)
    else:
        for c in range(0, D, BLOCK_D):
            mask = row_ok[:, None] & (c + cols < D)[None, :]
            if c == 0:
                _store_normalized(y_rows, x0 - mean[:, None], rstd, w0, b0, cols, mask, HAS_WEIGHT, HAS_BIAS, STREAM)
            else:
                x = load_tile(X, rows, c + cols, stride_xr, stride_xc, mask)
                w = load_vector(W, c + cols, D) if HAS_WEIGHT else None
                b = load_vector(B, c + cols, D) if HAS_BIAS else None
                _store_normalized(y_rows + c, x - mean[:, None], rstd, w, b, cols, mask, HAS_WEIGHT, HAS_BIAS,
                                  STREAM)


@triton.jit
def _store_normalized(Y_ROWS, centred, rstd, w, b, cols, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      STREAM: tl.constexpr):
    """``y = centred · rstd · w + b`` (``centred`` = x − mean) stored at ``Y_ROWS + cols`` (one
    pointer per row)."""
    y = centred * rstd[:, None]
    if HAS_WEIGHT:
        y *= w[None, :]
    if HAS_BIAS:
        y += b[None, :]
    store_output(Y_ROWS + cols[None, :], y.to(Y_ROWS.dtype.element_ty), mask, STREAM)


@triton.jit
def _bwd_chunk(X, DY, W, rows, cols, D, mean, rstd, stride_xr, stride_xc, stride_dyr, stride_dyc, mask,
               HAS_WEIGHT: tl.constexpr):
    """``(x̂, dy, g = dy · w)`` of a later chunk of the backward's rows (x̂ is 0 past the row's end)."""
    xhat = tl.where(mask, (load_tile(X, rows, cols, stride_xr, stride_xc, mask) - mean) * rstd, 0.0)
    dy = load_tile(DY, rows, cols, stride_dyr, stride_dyc, mask)
    g = dy * load_vector(W, cols, D)[None, :] if HAS_WEIGHT else dy
    return xhat, dy, g


@cached_launch
@triton.jit
def _layer_norm_bwd_kernel(
    X, W, MEAN, RSTD, DY, DX, DW_PART, DB_PART,  # W only with HAS_WEIGHT
    R, D,  # rows, columns; DX is contiguous [R, D], the partial buffers [programs, D] float32
    stride_xr, stride_xc, stride_dyr, stride_dyc,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # D <= BLOCK_D: no chunk loops are compiled in
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    if HAS_WEIGHT:
        w0 = load_vector(W, cols, D)
    # Partial sums of the first chunk live in registers; later chunks (rows wider than BLOCK_D
    # only) add into this program's own rows of the partial buffers.
    dw0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    db0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    inv_d = 1.0 / tl.maximum(D, 1).to(tl.float32)
    for r0 in range(pid * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = rows < R
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]

        # Pass 1: mean(g) and mean(g · x̂) over the row; the first chunk stays in registers.
        mask0 = row_ok[:, None] & (cols < D)[None, :]
        xhat0 = tl.where(mask0, (load_tile(X, rows, cols, stride_xr, stride_xc, mask0) - mean) * rstd, 0.0)
        dy0 = load_tile(DY, rows, cols, stride_dyr, stride_dyc, mask0)
        # g = dy · w goes through a select, which no multiply-add can fuse across: dx needs
        # g − mean(g) of the *rounded* products (one column: exactly 0), not an FMA's exact product
        g0 = tl.where(mask0, dy0 * w0[None, :], 0.0) if HAS_WEIGHT else dy0
        sum_g = tl.sum(g0, axis=1)
        sum_gx = tl.sum(g0 * xhat0, axis=1)
        if not ONE_CHUNK:
            for c in range(BLOCK_D, D, BLOCK_D):
                mask = row_ok[:, None] & (c + cols < D)[None, :]
                xhat, _, g = _bwd_chunk(X, DY, W, rows, c + cols, D, mean, rstd, stride_xr, stride_xc, stride_dyr,
                                        stride_dyc, mask, HAS_WEIGHT)
                sum_g += tl.sum(g, axis=1)
                sum_gx += tl.sum(g * xhat, axis=1)
        mean_g = (sum_g * inv_d)[:, None]
        mean_gx = (sum_gx * inv_d)[:, None]

        # Pass 2: dx, and the partial sums of dweight and dbias; the first chunk from registers.
        dx = rstd * (g0 - mean_g - xhat0 * mean_gx)
        tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask0)
        if HAS_WEIGHT:
            dw0 += tl.sum(dy0 * xhat0, axis=0)
        if HAS_BIAS:
            db0 += tl.sum(dy0, axis=0)
        if not ONE_CHUNK:
            for c in range(BLOCK_D, D, BLOCK_D):
                mask = row_ok[:, None] & (c + cols < D)[None, :]
                xhat, dy, g = _bwd_chunk(X, DY, W, rows, c + cols, D, mean, rstd, stride_xr, stride_xc, stride_dyr,
                                         stride_dyc, mask, HAS_WEIGHT)
                dx = rstd * (g - mean_g - xhat * mean_gx)
                tl.store(DX + rows[:, None] * D + c + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                col_ok = c + cols < D
                if HAS_WEIGHT:
                    part = DW_PART + pid * D + c + cols
                    tl.store(part, tl.load(part, mask=col_ok) + tl.sum(dy * xhat, axis=0), mask=col_ok)
                if HAS_BIAS:
                    part = DB_PART + pid * D + c + cols
                    tl.store(part, tl.load(part, mask=col_ok) + tl.sum(dy, axis=0), mask=col_ok)
    if HAS_WEIGHT:
        tl.store(DW_PART + pid * D + cols, dw0.to(DW_PART.dtype.element_ty), mask=cols < D)
    if HAS_BIAS:
        tl.store(DB_PART + pid * D + cols, db0.to(DB_PART.dtype.element_ty), mask=cols < D)


def layer_norm_fwd(x, weight, bias, eps, *, max_block: int = 16384, tile_elems: int = 2048,
                   elems_per_warp: int = 512, stream: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)``. Tuning: rows up to ``max_block`` columns are read once; each program
    normalizes about ``tile_elems`` elements with one warp per ``elems_per_warp``; ``stream``
    writes ``y`` as streamed data (see `kpt_triton.tiling.store_output`)."""
    x2 = rows(x)
    n_rows, d = x2.shape
    y = dense_like(x)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        grid, options = row_launch(n_rows, d, max_block, tile_elems, elems_per_warp, True,
                                   HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, STREAM=stream)
        stride_r, stride_c = x2.stride()
        _layer_norm_fwd_kernel.launch(grid, (x2, vector(weight), vector(bias), y, mean, rstd, n_rows, d,
                                             stride_r, stride_c, eps), options)
    return y, mean, rstd


def layer_norm_bwd(x, weight, bias, eps, y, mean, rstd, dy, *, max_block: int = 16384,
                   tile_elems: int = 2048, elems_per_warp: int = 512,
                   programs_per_sm: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``; ``programs_per_sm`` sizes the persistent grid (and the partial
    buffers: one float32 row per program and parameter)."""
    x2 = rows(x)
    n_rows, d = x2.shape
    dy2 = rows(dy)
    dx = dense_like(x)
    block_r, block_d = row_tiling(d, max_block=max_block, tile_elems=tile_elems, rows=n_rows)
    programs = persistent_programs(cdiv(n_rows, block_r), x.device, programs_per_sm)
    parts = [partial_sums(p, programs, d, d <= block_d, x) for p in (weight, bias)]
    if programs:
        _layer_norm_bwd_kernel[(programs,)](
            x2, vector(weight), mean, rstd, dy2, dx, *parts, n_rows, d,
            x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1),
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_R=block_r, BLOCK_D=block_d, ONE_CHUNK=d <= block_d,
            num_warps=warps(block_r * block_d, elems_per_warp),
        )
    return dx, total(parts[0], weight), total(parts[1], bias)
