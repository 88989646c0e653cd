"""RMS normalization (``rms_norm``) and its residual-fused form (``add_rms_norm``).

Forward, per row of ``D`` columns (statistics in float32)::

    h    = x + residual                       (add_rms_norm only; rounded to x.dtype)
    rstd = rsqrt(mean(h², -1) + eps)
    y    = h · rstd · weight

Backward, with ĥ = h · rstd and g = dy · weight::

    dh      = rstd · (g − ĥ · mean(g · ĥ, -1))  (+ the gradient of the output h)
    dweight = Σ_rows dy · ĥ

The forward gives each program ``BLOCK_R`` whole rows (one pass over memory when a row fits in
``BLOCK_D``). The backward runs a persistent grid; each program accumulates ``dweight`` for its
rows in float32 and writes one row of a partial buffer that the launcher sums afterwards.
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
    total,
    vector,
    warps,
)


@triton.jit
def _load_h(X, RES, H, rows, cols, D, stride_xr, stride_xc, stride_rr, stride_rc, mask,
            HAS_RESIDUAL: tl.constexpr):
    """x, or h = x + residual rounded to x.dtype and written to H, as float32."""
    h = load_tile(X, rows, cols, stride_xr, stride_xc, mask)
    if HAS_RESIDUAL:
        h = (h + load_tile(RES, rows, cols, stride_rr, stride_rc, mask)).to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * D + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)
    return h


@cached_launch
@triton.jit
def _rms_norm_fwd_kernel(
    X, RES, W, Y, H, RSTD,  # RES and H only with HAS_RESIDUAL, W only with HAS_WEIGHT
    R, D,  # rows, columns; Y and H are contiguous [R, D]
    stride_xr, stride_xc, stride_rr, stride_rc,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # D <= BLOCK_D: no chunk loops are compiled in
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    # the weight of the first chunk is requested before the row, so that both loads overlap (a
    # decode step's one row waited for it after its reduction: 1.8 against Liger's 1.6 µs on an H100)
    w0 = load_vector(W, cols, D) if HAS_WEIGHT else None

    # Pass 1: the sum of squares. The first chunk stays in registers for pass 2.
    mask0 = row_ok[:, None] & (cols < D)[None, :]
    h0 = _load_h(X, RES, H, rows, cols, D, stride_xr, stride_xc, stride_rr, stride_rc, mask0, HAS_RESIDUAL)
    sumsq = tl.sum(h0 * h0, axis=1)
    if not ONE_CHUNK:
        for c in range(BLOCK_D, D, BLOCK_D):
            mask = row_ok[:, None] & (c + cols < D)[None, :]
            h = _load_h(X, RES, H, rows, c + cols, D, stride_xr, stride_xc, stride_rr, stride_rc, mask,
                        HAS_RESIDUAL)
            sumsq += tl.sum(h * h, axis=1)
    # an empty row (D = 0) keeps a finite rstd: its mean square is taken as 0
    rstd = 1.0 / tl.sqrt(sumsq / tl.maximum(D, 1).to(tl.float32) + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)

    # Pass 2: normalize. Later chunks are read again (from H, one read instead of two, if written).
    _store_rms_normalized(Y, rows, cols, D, h0, rstd, w0, mask0, HAS_WEIGHT)
    if not ONE_CHUNK:
        for c in range(BLOCK_D, D, BLOCK_D):
            mask = row_ok[:, None] & (c + cols < D)[None, :]
            if HAS_RESIDUAL:
                h = load_tile(H, rows, c + cols, D, 1, mask)
            else:
                h = load_tile(X, rows, c + cols, stride_xr, stride_xc, mask)
            w = load_vector(W, c + cols, D) if HAS_WEIGHT else None
            _store_rms_normalized(Y, rows, c + cols, D, h, rstd, w, mask, HAS_WEIGHT)


@triton.jit
def _store_rms_normalized(Y, rows, cols, D, h, rstd, w, mask, HAS_WEIGHT: tl.constexpr):
    """``y = h · rstd · w`` (``w`` the weight's values at ``cols``) stored at columns ``cols`` of the
    contiguous ``[R, D]`` output."""
    y = h * rstd[:, None]
    if HAS_WEIGHT:
        y *= w[None, :]
    tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _rms_norm_bwd_kernel(
    H, W, RSTD, DY, DH, DX, DW_PART,  # W only with HAS_WEIGHT, DH only with HAS_DH
    R, D,  # rows, columns; DX is contiguous [R, D], DW_PART [programs, D] float32
    stride_hr, stride_hc, stride_dyr, stride_dyc, stride_dhr, stride_dhc,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # D <= BLOCK_D: no chunk loops are compiled in
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    if HAS_WEIGHT:
        w0 = load_vector(W, cols, D)
    # dweight of the first chunk accumulates in registers; later chunks (rows wider than
    # BLOCK_D only) add into this program's own row of DW_PART, which no other program touches.
    dw0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r0 in range(pid * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = rows < R
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]

        # Pass 1: mean(g · ĥ) over the row; the first chunk stays in registers.
        mask0 = row_ok[:, None] & (cols < D)[None, :]
        hhat0 = load_tile(H, rows, cols, stride_hr, stride_hc, mask0) * rstd
        dy0 = load_tile(DY, rows, cols, stride_dyr, stride_dyc, mask0)
        g0 = dy0 * w0[None, :] if HAS_WEIGHT else dy0
        dot = tl.sum(g0 * hhat0, axis=1)
        if not ONE_CHUNK:
            for c in range(BLOCK_D, D, BLOCK_D):
                mask = row_ok[:, None] & (c + cols < D)[None, :]
                hhat = load_tile(H, rows, c + cols, stride_hr, stride_hc, mask) * rstd
                g = load_tile(DY, rows, c + cols, stride_dyr, stride_dyc, mask)
                if HAS_WEIGHT:
                    g *= load_vector(W, c + cols, D)[None, :]
                dot += tl.sum(g * hhat, axis=1)
        mean_dot = (dot / tl.maximum(D, 1).to(tl.float32))[:, None]

        # Pass 2: dx, and the dweight partial sums; the first chunk from registers.
        _store_rms_dx(DX, DH, rows, cols, D, stride_dhr, stride_dhc, g0, hhat0, rstd, mean_dot, mask0, HAS_DH)
        if HAS_WEIGHT:
            dw0 += tl.sum(dy0 * hhat0, axis=0)
        if not ONE_CHUNK:
            for c in range(BLOCK_D, D, BLOCK_D):
                mask = row_ok[:, None] & (c + cols < D)[None, :]
                hhat = load_tile(H, rows, c + cols, stride_hr, stride_hc, mask) * rstd
                dy = load_tile(DY, rows, c + cols, stride_dyr, stride_dyc, mask)
                g = dy
                if HAS_WEIGHT:
                    g = dy * load_vector(W, c + cols, D)[None, :]
                _store_rms_dx(DX, DH, rows, c + cols, D, stride_dhr, stride_dhc, g, hhat, rstd, mean_dot, mask, HAS_DH)
                if HAS_WEIGHT:
                    part = DW_PART + pid * D + c + cols
                    tl.store(part, tl.load(part, mask=c + cols < D) + tl.sum(dy * hhat, axis=0),
                             mask=c + cols < D)
    if HAS_WEIGHT:
        tl.store(DW_PART + pid * D + cols, dw0.to(DW_PART.dtype.element_ty), mask=cols < D)


@triton.jit
def _store_rms_dx(DX, DH, rows, cols, D, stride_dhr, stride_dhc, g, hhat, rstd, mean_dot, mask, HAS_DH: tl.constexpr):
    """``dx = rstd · (g − ĥ · mean(g · ĥ))`` (plus the gradient of the output h) at columns ``cols``."""
    dx = rstd * (g - hhat * mean_dot)
    if HAS_DH:
        dx += load_tile(DH, rows, cols, stride_dhr, stride_dhc, mask)
    tl.store(DX + rows[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


def _forward(x, residual, weight, eps, max_block, tile_elems, elems_per_warp):
    x2 = rows(x)
    n_rows, d = x2.shape
    y = dense_like(x)
    h = dense_like(x) if residual is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    res2 = rows(residual) if residual is not None else x2
    if n_rows:
        grid, options = row_launch(n_rows, d, max_block, tile_elems, elems_per_warp, True,
                                   HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None)
        stride_xr, stride_xc = x2.stride()
        stride_rr, stride_rc = res2.stride()
        _rms_norm_fwd_kernel.launch(grid, (x2, res2, vector(weight), y, h, rstd, n_rows, d,
                                           stride_xr, stride_xc, stride_rr, stride_rc, eps), options)
    return y, h, rstd


def _backward(h, weight, rstd, dy, dh, max_block, tile_elems, elems_per_warp, programs_per_sm, one_program_tiles):
    h2 = rows(h)
    n_rows, d = h2.shape
    dy2 = rows(dy) if dy is not None else torch.zeros_like(h2)
    dh2 = rows(dh) if dh is not None else h2
    dx = dense_like(h)
    block_r, block_d = row_tiling(d, max_block=max_block, tile_elems=tile_elems, rows=n_rows)
    tiles = cdiv(n_rows, block_r)
    # a few tiles in one program: it writes the weight's gradient itself, with no partial sums to add
    programs = 1 if tiles <= one_program_tiles else persistent_programs(tiles, h.device, programs_per_sm)
    part = partial_sums(weight, programs, d, d <= block_d, h)
    if programs:
        _rms_norm_bwd_kernel[(programs,)](
            h2, vector(weight), rstd, dy2, dh2, dx, part, n_rows, d,
            h2.stride(0), h2.stride(1), dy2.stride(0), dy2.stride(1), dh2.stride(0), dh2.stride(1),
            HAS_WEIGHT=weight is not None, HAS_DH=dh is not None,
            BLOCK_R=block_r, BLOCK_D=block_d, ONE_CHUNK=d <= block_d,
            num_warps=warps(block_r * block_d, elems_per_warp),
        )
    return dx, total(part, weight)


def rms_norm_fwd(x, weight, eps, *, max_block: int = 16384, tile_elems: int = 2048,
                 elems_per_warp: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``. Tuning: rows up to ``max_block`` columns are read once; each program
    normalizes about ``tile_elems`` elements with one warp per ``elems_per_warp``."""
    y, _, rstd = _forward(x, None, weight, eps, max_block, tile_elems, elems_per_warp)
    return y, rstd


def rms_norm_bwd(x, weight, eps, y, rstd, dy, *, max_block: int = 16384, tile_elems: int = 2048,
                 elems_per_warp: int = 512, programs_per_sm: int = 4,
                 one_program_tiles: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)``; ``programs_per_sm`` sizes the persistent grid (and the partial
    ``dweight`` buffer: one float32 row per program, summed and cast after the kernel), except
    that up to ``one_program_tiles`` tiles of rows run in one program, which writes ``dweight``
    itself (a decode step's few rows: two kernels fewer)."""
    return _backward(x, weight, rstd, dy, None, max_block, tile_elems, elems_per_warp, programs_per_sm,
                     one_program_tiles)


def add_rms_norm_fwd(x, residual, weight, eps, *, max_block: int = 16384, tile_elems: int = 2048,
                     elems_per_warp: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd)`` with ``h = x + residual``; tuning as `rms_norm_fwd`."""
    return _forward(x, residual, weight, eps, max_block, tile_elems, elems_per_warp)


def add_rms_norm_bwd(x, residual, weight, eps, y, h, rstd, dy, dh, *, max_block: int = 16384,
                     tile_elems: int = 2048, elems_per_warp: int = 512,
                     programs_per_sm: int = 4, one_program_tiles: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh_total, dweight)``: ``dh_total`` is the gradient of both ``x`` and ``residual``; tuning
    as `rms_norm_bwd`."""
    return _backward(h, weight, rstd, dy, dh, max_block, tile_elems, elems_per_warp, programs_per_sm,
                     one_program_tiles)
