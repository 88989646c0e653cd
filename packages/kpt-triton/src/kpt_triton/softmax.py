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

Rows too few to give every multiprocessor two programs (a decode step's one row over a whole
vocabulary) are cut into spans (`kpt_triton.tiling.row_split`), one program each: a first kernel
writes each span's partial statistics — ``(m, s)`` of the online sum, or ``Σ dy · y`` — and a
second merges them per row and writes its span of ``y`` or ``dx``. The partial log-sum-exp
statistics (`lse_stats`, `lse_parts_kernel`, `merged_stats`) are cross-entropy's too.

Rows of one program each whose width or row stride is not a multiple of 16 (an odd vocabulary)
go to the span kernel too, one span a row that reads its own statistics first: it reads them in
aligned 16-byte vectors around a small head and tail (`kpt_triton.tiling.row_vector`), which the
whole-row kernel's tiles cannot, and Triton would otherwise read such a row two bytes at a time.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import cached_launch
from .tiling import (
    aligned,
    aligned_span,
    cdiv,
    dense_like,
    edge_columns,
    nan_max,
    next_pow2,
    row_launch,
    row_split,
    row_tiling,
    row_vector,
    store_output,
    warps,
)


@triton.jit
def _pointers(BASE, rows, cols, inner, stride_o, stride_d, stride_i):
    """Pointers to ``rows × cols`` of an ``[outer, D, inner]`` tensor (``rows`` int64): one 64-bit
    base per row plus 32-bit column offsets (no 64-bit arithmetic per element)."""
    row_base = BASE + (rows // inner) * stride_o + (rows % inner) * stride_i
    return row_base[:, None] + (cols * stride_d)[None, :]


@triton.jit
def _logits(Z_AT, BIAS, col0, cols, mask, stride_zv, HAS_BIAS: tl.constexpr):
    """Logits ``cols`` from the row pointer ``Z_AT`` (plus the bias from column ``col0``) as float32, −inf
    outside ``mask``; kept in L2 for the pass that reads them again, where they fit."""
    z = tl.load(Z_AT + cols * stride_zv, mask=mask, other=-float("inf"), eviction_policy="evict_last").to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + col0 + cols, mask=mask, other=0.0).to(tl.float32)
    return z


@triton.jit
def _fold(m, s, z_sum, z, mask, SMOOTHING: tl.constexpr):
    """`lse_stats`'s running ``(m, s, Σz)`` with the logits ``z`` added."""
    # NaN-propagating: a NaN logit beside a +inf one makes the row NaN, not +inf
    m_new = tl.maximum(m, nan_max(z, 0), propagate_nan=tl.PropagateNan.ALL)
    # while every logit so far is −inf (a masked head of the vocabulary) there is nothing to sum,
    # and exp(−inf − (−inf)) would be NaN
    s = tl.where(m_new == -float("inf"), 0.0, s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0))
    if SMOOTHING:
        z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    return m_new, s, z_sum


@triton.jit
def lse_stats(Z, start, BIAS, lo, hi, stride_zv, HAS_BIAS: tl.constexpr, SMOOTHING: tl.constexpr,
              BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """``(m, s, Σz)`` over columns ``[lo, hi)`` of the row whose column 0 is element ``start`` of
    ``Z``: the maximum, ``Σ exp(z − m)`` (online: ``s ← s · exp(m − m') + Σ exp(z − m')`` whenever
    the maximum grows) and, with ``SMOOTHING``, the sum of the logits. With ``VEC`` > 1
    (`kpt_triton.tiling.row_vector`) the columns between aligned vectors are read first, then the
    aligned ones in 16-byte vectors."""
    m = -float("inf")
    s = 0.0
    z_sum = 0.0
    a, n = aligned_span(start, lo, hi, VEC)
    if VEC > 1:
        edge, edge_mask = edge_columns(lo, a, n, hi, VEC)
        z = _logits(Z + start, BIAS, 0, edge, edge_mask, stride_zv, HAS_BIAS)
        m, s, z_sum = _fold(m, s, z_sum, z, edge_mask, SMOOTHING)
    z_at = Z + aligned(start, a, stride_zv, VEC)
    cols = tl.arange(0, BLOCK_V)
    for c in range(0, n, BLOCK_V):
        mask = c + cols < n
        m, s, z_sum = _fold(m, s, z_sum, _logits(z_at, BIAS, a, c + cols, mask, stride_zv, HAS_BIAS), mask,
                            SMOOTHING)
    return m, s, z_sum


@triton.jit
def lse_terms(m, s):
    """log Σ exp from `lse_stats` as two terms, ``(m, log s)``, which a caller subtracts one after
    the other: ``z − m`` is exact for the logits that matter, and ``log s`` lies in [0, log V].
    Their float32 sum is off by up to half an ulp of ``m`` (2^-11 at 1e4), which ``exp(z − lse)``
    would carry into every probability of a row of large logits. A +inf logit makes s NaN
    (inf − inf): the terms are then ``(inf, 0)``, a log-sum-exp of +inf, as in the reference."""
    return m, tl.where(m == float("inf"), 0.0, tl.log(s))


@cached_launch
@triton.jit
def lse_parts_kernel(Z, BIAS, PARTS, V, stride_zn, stride_zv, span, HAS_BIAS: tl.constexpr,
                     SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """`lse_stats` of span ``program_id(1)`` (``span`` columns) of row ``program_id(0)``, into
    ``PARTS[row, span, :3]``: a row cut across programs when the rows are too few to fill the GPU."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    m, s, z_sum = lse_stats(Z, row * stride_zn, BIAS, lo, tl.minimum(lo + span, V), stride_zv, HAS_BIAS,
                            SMOOTHING, BLOCK_V, VEC)
    out = PARTS + (row * tl.num_programs(1) + tl.program_id(1)) * 3
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, z_sum)


@triton.jit
def merged_stats(PARTS, row, n_parts, SMOOTHING: tl.constexpr, BLOCK_P: tl.constexpr):
    """Row ``row``'s ``(m, s, Σz)`` from the ``n_parts`` partial statistics `lse_parts_kernel`
    wrote (``Σz`` only with ``SMOOTHING``, else 0)."""
    p = tl.arange(0, BLOCK_P)
    stats = PARTS + (row * n_parts + p) * 3
    m_p = tl.load(stats, mask=p < n_parts, other=-float("inf"))
    m = nan_max(m_p, 0)
    # a span of −inf only has s = 0, and exp(−inf − m) would be NaN where m is −inf too
    s = tl.sum(tl.where(m_p == -float("inf"), 0.0, tl.load(stats + 1, mask=p < n_parts, other=0.0)
                        * tl.exp(m_p - m)), axis=0)
    z_sum = 0.0
    if SMOOTHING:
        z_sum = tl.sum(tl.load(stats + 2, mask=p < n_parts, other=0.0), axis=0)
    return m, s, z_sum


@triton.jit
def _dot(Y_AT, DY_AT, cols, mask, stride_yd, stride_dyd):
    """``Σ dy · y`` over columns ``cols`` of the rows at ``Y_AT`` and ``DY_AT``."""
    y = tl.load(Y_AT + cols * stride_yd, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    dy = tl.load(DY_AT + cols * stride_dyd, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return tl.sum(y * dy, axis=0)


@triton.jit
def _dot_span(Y, DY, start_y, start_dy, lo, hi, stride_yd, stride_dyd, BLOCK_D: tl.constexpr, VEC: tl.constexpr):
    """``Σ dy · y`` over columns ``[lo, hi)`` of the rows whose column 0 is element ``start_y`` of
    ``Y`` and ``start_dy`` of ``DY``; aligned as `lse_stats`."""
    dot = 0.0
    a, n = aligned_span(start_y, lo, hi, VEC)
    if VEC > 1:
        edge, edge_mask = edge_columns(lo, a, n, hi, VEC)
        dot += _dot(Y + start_y, DY + start_dy, edge, edge_mask, stride_yd, stride_dyd)
    y_at = Y + aligned(start_y, a, stride_yd, VEC)
    dy_at = DY + aligned(start_dy, a, stride_dyd, VEC)
    cols = tl.arange(0, BLOCK_D)
    for c in range(0, n, BLOCK_D):
        dot += _dot(y_at, dy_at, c + cols, c + cols < n, stride_yd, stride_dyd)
    return dot


@cached_launch
@triton.jit
def _softmax_dot_parts_kernel(Y, DY, PARTS, D, stride_yr, stride_yd, stride_dyr, stride_dyd, span,
                              BLOCK_D: tl.constexpr, VEC: tl.constexpr):
    """``Σ dy · y`` over span ``program_id(1)`` of row ``program_id(0)``, into ``PARTS[row, span]``."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    dot = _dot_span(Y, DY, row * stride_yr, row * stride_dyr, lo, tl.minimum(lo + span, D), stride_yd, stride_dyd,
                    BLOCK_D, VEC)
    tl.store(PARTS + row * tl.num_programs(1) + tl.program_id(1), dot)


@triton.jit
def _write(X_AT, DY_AT, OUT_AT, cols, mask, stride_xd, stride_dyd, stride_od, m, inv, dot, BACKWARD: tl.constexpr):
    """Columns ``cols`` of the output row at ``OUT_AT``: ``exp(x − m) · inv``, or with ``BACKWARD``
    ``y · (dy − dot)`` (X is y)."""
    x = tl.load(X_AT + cols * stride_xd, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if BACKWARD:
        dy = tl.load(DY_AT + cols * stride_dyd, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        out = x * (dy - dot)
    else:
        out = tl.exp(x - m) * inv
    tl.store(OUT_AT + cols * stride_od, out.to(OUT_AT.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _softmax_span_kernel(X, DY, OUT, PARTS, D, stride_xr, stride_xd, stride_dyr, stride_dyd, stride_or, stride_od,
                         span, BACKWARD: tl.constexpr, OWN_STATS: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_P: tl.constexpr, VEC: tl.constexpr):
    """Span ``program_id(1)`` of row ``program_id(0)``: the forward's ``y = exp(x − m) / s`` (X is
    x), or with ``BACKWARD`` ``dx = y · (dy − Σ dy · y)`` (X is y), from the row's partial statistics
    in ``PARTS``, or with ``OWN_STATS`` (one span a row) from statistics this program reads first.
    With ``VEC`` > 1 (`kpt_triton.tiling.row_vector`) in aligned 16-byte vectors."""
    row = tl.program_id(0).to(tl.int64)
    n_parts = tl.num_programs(1)
    start_x, start_dy, start_o = row * stride_xr, row * stride_dyr, row * stride_or
    m, inv, dot = 0.0, 0.0, 0.0
    if BACKWARD:
        if OWN_STATS:
            dot = _dot_span(X, DY, start_x, start_dy, 0, D, stride_xd, stride_dyd, BLOCK_D, VEC)
        else:
            p = tl.arange(0, BLOCK_P)
            dot = tl.sum(tl.load(PARTS + row * n_parts + p, mask=p < n_parts, other=0.0), axis=0)
    else:
        if OWN_STATS:
            m, s, _ = lse_stats(X, start_x, X, 0, D, stride_xd, False, False, BLOCK_D, VEC)
        else:
            m, s, _ = merged_stats(PARTS, row, n_parts, False, BLOCK_P)
        inv = 1.0 / s
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, D)
    a, n = aligned_span(start_x, lo, hi, VEC)
    if VEC > 1:
        edge, edge_mask = edge_columns(lo, a, n, hi, VEC)
        _write(X + start_x, DY + start_dy, OUT + start_o, edge, edge_mask, stride_xd, stride_dyd, stride_od, m, inv,
               dot, BACKWARD)
    x_at = X + aligned(start_x, a, stride_xd, VEC)
    dy_at = DY + aligned(start_dy, a, stride_dyd, VEC)
    out_at = OUT + aligned(start_o, a, stride_od, VEC)
    cols = tl.arange(0, BLOCK_D)
    for c in range(0, n, BLOCK_D):
        _write(x_at, dy_at, out_at, c + cols, c + cols < n, stride_xd, stride_dyd, stride_od, m, inv, dot, BACKWARD)


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


def _spans(x3: torch.Tensor, chunk: int, max_block: int) -> tuple[int, int] | None:
    """``(block, span)`` where the rows of ``x3`` (``[outer, D, inner]``) are cut into spans
    (`kpt_triton.tiling.row_split`); None where they stay whole: enough rows to fill the device,
    rows of one chunk, or rows that do not form one strided matrix (outer and inner both above 1).

    Spans read a row twice (statistics, then output). Where the whole-row kernel reads little
    twice — a row of one ``max_block`` chunk, or of two ``chunk`` chunks, the first kept in
    registers — rows are cut only from four multiprocessors a row: on the H100, 64 rows of 32000
    took 6.2 µs cut in two against 5.3 whole, 32 rows 4.7 cut in four against 5.2; 64 rows of
    128256 (eight chunks) 16.3 cut in two against 21.8 whole."""
    outer, d, inner = x3.shape
    if outer > 1 and inner > 1:
        return None
    chunks = 1 if d <= max_block else cdiv(d, chunk)
    block, span = row_split(outer * inner, d, min(next_pow2(d), chunk), x3.device,
                            min_per_row=4 if chunks <= 2 else 2)
    return (block, span) if span < d else None


def _row_strides(t3: torch.Tensor) -> tuple[int, int]:
    """``(row stride, column stride)`` of an ``[outer, D, inner]`` tensor whose outer or inner size is 1."""
    return t3.stride(2) if t3.shape[0] == 1 else t3.stride(0), t3.stride(1)


def _vector(*t3s: torch.Tensor) -> int:
    """The vector (`kpt_triton.tiling.row_vector`) in which one program reads one row of the
    ``[outer, D, inner]`` tensors ``t3s``; 1 where they are not one strided matrix each. Rows the
    whole-row kernel would read one a program go to the span kernel where this is above 1 (an odd
    vocabulary: on the H100, 4096 × 50257 forward 701 against eager's 393 µs before)."""
    outer, d, inner = t3s[0].shape
    if outer > 1 and inner > 1:
        return 1
    return row_vector(d, *((t, *_row_strides(t)) for t in t3s))


def softmax_fwd(x, dim, *, max_block: int = 16384, chunk: int = 16384, tile_elems: int = 2048,
                elems_per_warp: int = 512, stream: bool = False) -> tuple[torch.Tensor]:
    """``(y,)``. Tuning: rows up to ``max_block`` long are read once, longer ones twice in chunks
    of ``chunk`` columns (rows too few to fill the device: in spans, chunks of at most ``chunk``);
    each program handles about ``tile_elems`` elements with one warp per ``elems_per_warp``;
    ``stream`` writes ``y`` as streamed data (see `kpt_triton.tiling.store_output`)."""
    x3 = _as_3d(x, dim)
    outer, d, inner = x3.shape
    y = dense_like(x)
    n_rows = outer * inner
    if not (n_rows and d):
        return (y,)
    y3 = _as_3d(y, dim)
    grid, options = row_launch(n_rows, d, max_block, tile_elems, elems_per_warp, False, chunk, STREAM=stream)
    block_r, block_d = options["BLOCK_R"], options["BLOCK_D"]
    spans = _spans(x3, chunk, max_block)
    vec = _vector(x3, y3) if spans is not None or block_r == 1 else 1
    if spans is not None:
        block, span = spans
        n_parts, num_warps = cdiv(d, span), warps(block, elems_per_warp)
        parts = torch.empty(n_rows, n_parts, 3, dtype=torch.float32, device=x.device)
        lse_parts_kernel[(n_rows, n_parts)](x3, x3, parts, d, *_row_strides(x3), span, HAS_BIAS=False,
                                            SMOOTHING=False, BLOCK_V=block, VEC=vec, num_warps=num_warps)
    elif vec > 1:
        block, span, n_parts, num_warps, parts = block_d, d, 1, warps(block_d, elems_per_warp), None
    else:
        _softmax_fwd_kernel.launch(grid, (x3, y, n_rows, d, inner, *x3.stride()), options)
        return (y,)
    _softmax_span_kernel[(n_rows, n_parts)](
        x3, x3, y, parts, d, *_row_strides(x3), 0, 0, *_row_strides(y3), span, BACKWARD=False, OWN_STATS=parts is None,
        BLOCK_D=block, BLOCK_P=next_pow2(n_parts), VEC=vec, num_warps=num_warps)
    return (y,)


def softmax_bwd(x, dim, y, dy, *, max_block: int = 16384, chunk: int = 16384, tile_elems: int = 2048,
                elems_per_warp: int = 512, tile_elems_at: tuple[tuple[int, int], ...] = ()) -> tuple[torch.Tensor]:
    """``(dx,)`` from the saved output ``y``; tuning as `softmax_fwd`, and ``tile_elems_at``: pairs
    ``(width, elements)`` that give rows of exactly that width their own tile size (why exact widths,
    not block widths: `kpt_cuda.tuning`)."""
    dx = dense_like(x)
    y3, dy3 = _as_3d(y, dim), _as_3d(dy, dim)
    outer, d, inner = y3.shape
    n_rows = outer * inner
    if not (n_rows and d):
        return (dx,)
    dx3 = _as_3d(dx, dim)
    tile_elems = next((elems for width, elems in tile_elems_at if width == d), tile_elems)
    block_r, block_d = row_tiling(d, max_block=max_block, tile_elems=tile_elems, chunk=chunk, rows=n_rows)
    spans = _spans(y3, chunk, max_block)
    vec = _vector(y3, dy3, dx3) if spans is not None or block_r == 1 else 1
    if spans is not None:
        block, span = spans
        n_parts, num_warps = cdiv(d, span), warps(block, elems_per_warp)
        parts = torch.empty(n_rows, n_parts, dtype=torch.float32, device=x.device)
        _softmax_dot_parts_kernel[(n_rows, n_parts)](y3, dy3, parts, d, *_row_strides(y3), *_row_strides(dy3), span,
                                                     BLOCK_D=block, VEC=vec, num_warps=num_warps)
    elif vec > 1:
        block, span, n_parts, num_warps, parts = block_d, d, 1, warps(block_d, elems_per_warp), None
    else:
        _softmax_bwd_kernel[(cdiv(n_rows, block_r),)](
            y3, dy3, dx, n_rows, d, inner, *y3.stride(), *dy3.stride(),
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps(block_r * block_d, elems_per_warp),
        )
        return (dx,)
    _softmax_span_kernel[(n_rows, n_parts)](
        y3, dy3, dx, parts, d, *_row_strides(y3), *_row_strides(dy3), *_row_strides(dx3), span, BACKWARD=True,
        OWN_STATS=parts is None, BLOCK_D=block, BLOCK_P=next_pow2(n_parts), VEC=vec, num_warps=num_warps)
    return (dx,)
