"""Flash attention: tiled, online softmax, the [Sq, Skv] score matrix never held in memory.

For one (batch, query head) with kv head ``h // (Hq / Hkv)`` (grouped-query):

    s   = scale · q kᵀ,  masked to -inf where key j is hidden from query i
    lse = log Σ_j exp(s_ij)                 (natural log, float32, [B, Hq, Sq])
    o   = exp(s − lse) v

Causal masking is aligned bottom-right: query i sees key j iff ``j <= i + Skv − Sq``. A query
that sees no key (``i < Sq − Skv``, or ``Skv == 0``) gets ``o = 0`` and ``lse = -inf``, and its
gradients are zero; nothing along the way is NaN.

A boolean ``mask`` (the kernels' ``HAS_MASK``) hides the pairs where it is False, on top of the
causal mask: core passes it broadcast to ``[B, Hq, Sq, Skv]`` (stride 0 where it broadcasts), and
the kernels read its tiles by those strides, as bytes, next to each block of scores. A hidden pair
gets a -inf score in the forward and p = 0 in the backward. The mask skips no block (only the causal
mask does), so a query whose keys it hides entirely gets o = 0 and lse = -inf as above, and in the
split decode a chunk of keys all hidden from a query gives that query lse = -inf there, which adds
nothing to the merge. Without a mask its pointer and strides are None: the kernels compile as before.

Forward, per block of queries, streaming over blocks of keys, in base 2 with ``t = q kᵀ`` and
``c = scale · log2 e`` (one multiply-add per score)::

    m' = max(m, max_j c·t_ij);  p = 2^(c·t − m');  l = l·2^(m − m') + Σ_j p;  acc = acc·2^(m − m') + p v
    o = acc / l;  lse = (m + log2 l) · ln 2

Backward (FlashAttention-2), with p recomputed from the saved lse::

    p = 2^(c·t − lse·log2 e);  δ_i = Σ_d do_id · o_id;  dp = do vᵀ;  ds = p ∘ (dp − δ)
    dv = pᵀ do;  dk = scale · dsᵀ q;  dq = scale · ds k

The recomputed p differs from the forward's by the rounding of the scores (relative ``ε·|s|``),
so with scores in the hundreds float32 gradients carry errors of about 1e-5 relative.

One kernel owns a block of keys and accumulates dk, dv over every query head of its group (no
atomics); a second kernel owns a block of queries and accumulates dq.

Special values (``kpt.kernels``) in the forward give what the reference's dense math gives: a NaN
score makes its row's o and lse NaN; a +inf score gives lse = +inf and o = NaN (exp(inf − inf));
a key hidden by the causal mask never enters a score (NaN or inf in its q·k is masked away), but
the reference's ``p · v`` still multiplies its v row by p = 0, so an inf or NaN there makes that
column of o NaN for every query it is hidden from, a query that sees no key included. The key
blocks past the diagonal are never loaded, so with a causal mask and more than one query a pass
over v first records per column the last row holding an inf or NaN (`_last_nonfinite_kernel`),
and the forward's epilogue applies it: one read of v, nothing in the inner loop.

The backward skips the key blocks past the diagonal but computes the hidden pairs inside the
diagonal blocks (with p = 0): an inf or NaN met only in pairs hidden by the causal mask reaches a
gradient as the reference's dense products carry it (0 · inf = NaN) where it lies in a diagonal
block, and adds nothing where it lies in a skipped one, which the contract allows (`kpt.kernels`,
"Special values"). The rows and columns that pad a partial tile get p = 0 as hidden pairs do, so an
inf in q or k never meets their zeros as inf · 0 = NaN.

Head dims that are not powers of two are padded in registers and masked. Under
``TRITON_INTERPRET=1`` the dot operands are promoted to float32 (the interpreter has no 16-bit
dot), so the numerics run on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_tiles, tiling
from .attention_tiles import PORTABLE_DECODE, Decode, Tiles, TilesByHeadDim
from .launch import cached_launch
from .linear import DOT_FP32, dot, dot_precision
from .tiling import cdiv, next_pow2

_LOG2E = 1.4426950408889634
LOG2E: tl.constexpr = tl.constexpr(_LOG2E)


@triton.jit
def _load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # masks only where a tile can cross the tensor's edge, so full tiles load unpredicated
    if CHECK_ROWS:
        if CHECK_COLS:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    if CHECK_COLS:
        return tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _load_mask(ptrs, rows, n_rows, cols, n_cols, CHECK_COLS: tl.constexpr):
    """A tile of the boolean mask (read as bytes): True where the query may attend the key, False past
    ``n_rows`` (always checked: the rows are queries or keys of a partial tile) and ``n_cols``."""
    return _load_tile(ptrs, rows, n_rows, cols, n_cols, True, CHECK_COLS) != 0


@triton.jit
def _load_rows(base, rows, n_rows, stride_r, stride_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """``[len(rows), BLOCK_D]`` rows of one head (zeros past ``n_rows`` and past the head dim)."""
    offs_d = tl.arange(0, BLOCK_D)
    return _load_tile(base + rows[:, None] * stride_r + offs_d[None, :] * stride_d,
                      rows, n_rows, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)


@triton.jit
def _store_rows(base, rows, n_rows, stride_r, value, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(base + rows[:, None] * stride_r + offs_d[None, :], value.to(base.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _causal_range(start_m, shift, Skv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For queries ``start_m + [0, BLOCK_M)``: the end of the key blocks every one of them sees
    whole (no mask needed), and the end of the keys the last of them sees."""
    full = tl.minimum(tl.maximum(start_m + shift + 1, 0), Skv) // BLOCK_N * BLOCK_N
    hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), Skv)
    return full, hi


@triton.jit
def _last_nonfinite_kernel(
    X, LAST,  # X [B, H, N, D]; LAST contiguous int32 [B, H, D]
    stride_b, stride_h, stride_n, stride_d, H, N,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``LAST[b, h, d]``: the last row of ``X[b, h]`` whose element ``d`` is ±inf or NaN, -1 if none."""
    bh = tl.program_id(0).to(tl.int64)
    base = X + bh // H * stride_b + bh % H * stride_h
    offs_d = tl.arange(0, BLOCK_D)
    last = tl.full([BLOCK_D], -1, dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        x = _load_rows(base, rows, N, stride_n, stride_d, HEAD_DIM, BLOCK_D).to(tl.float32)
        last = tl.maximum(last, tl.max(tl.where(tl.abs(x) < float("inf"), -1, rows[:, None]), 0))
    tl.store(LAST + bh * HEAD_DIM + offs_d, last, mask=offs_d < HEAD_DIM)


@triton.jit
def _attn_fwd_blocks(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, lo, hi, qk_scale, shift, Skv,
    mask_rows, rows, n_rows, stride_mn,  # with HAS_MASK: each tile row's mask row (its key 0), the
    # rows' indices and count (the mask is read only for rows < n_rows)
    MASK: tl.constexpr,  # apply the key-range and causal masks (diagonal and tail blocks only)
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_tile(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
                        offs_d, HEAD_DIM, offs_n, Skv, HEAD_DIM != BLOCK_D, MASK)
        qk = dot(q, kt, None, DOT_FP32, PRECISION)
        if MASK or HAS_MASK:
            if MASK:
                visible = offs_n[None, :] < Skv
                if CAUSAL:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
                if HAS_MASK:
                    visible = visible & _load_mask(mask_rows[:, None] + offs_n[None, :] * stride_mn,
                                                   rows, n_rows, offs_n, Skv, True)
            else:
                visible = _load_mask(mask_rows[:, None] + offs_n[None, :] * stride_mn, rows, n_rows,
                                     offs_n, Skv, False)
            # masked after scaling, so that scale = 0 never meets -inf
            s = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        # m is subtracted only where finite: a row that has seen no key yet keeps m = -inf (exp2(-inf)
        # = 0, not NaN), one that met a +inf score gets m = +inf and l = +inf (lse = +inf as the
        # reference's logsumexp; o = acc / l is NaN as the reference's exp(inf - inf))
        m_sub = tl.where(tl.abs(m_new) < float("inf"), m_new, 0.0)
        if MASK or HAS_MASK:
            p = tl.exp2(s - m_sub[:, None])
        else:
            p = tl.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                       offs_n, Skv, offs_d, HEAD_DIM, MASK, HEAD_DIM != BLOCK_D)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_FP32, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, OUT, LSE,  # OUT contiguous [B, Hq, Sq, D], LSE contiguous [B, Hq, Sq]
    LAST,  # with HIDDEN_KEYS: `_last_nonfinite_kernel` of V, int32 [B, Hkv, D]
    MASK,  # with HAS_MASK: the boolean mask [B, Hq, Sq, Skv] as bytes, by its strides (0 where broadcast)
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hq, GROUP, Sq, Skv,  # GROUP = Hq // Hkv query heads share one kv head
    qk_scale,  # scale · log2(e): the softmax runs in base 2
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    HIDDEN_KEYS: tl.constexpr,  # causal with Sq > 1: some keys are hidden from some queries
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, Sq, stride_qm, stride_qd, HEAD_DIM, BLOCK_D)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    mask_rows = MASK  # None without a mask
    if HAS_MASK:
        mask_rows = MASK + b * stride_mb + h * stride_mh + offs_m * stride_mm

    shift = Skv - Sq
    if CAUSAL:
        full, hi = _causal_range(start_m, shift, Skv, BLOCK_M, BLOCK_N)
    else:
        full = Skv // BLOCK_N * BLOCK_N
        hi = Skv

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                     stride_vd, offs_m, 0, full, qk_scale, shift, Skv, mask_rows, offs_m, Sq,
                                     stride_mn, False, CAUSAL, HAS_MASK, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_FP32,
                                     PRECISION)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                     stride_vd, offs_m, full, hi, qk_scale, shift, Skv, mask_rows, offs_m, Sq,
                                     stride_mn, True, CAUSAL, HAS_MASK, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_FP32,
                                     PRECISION)

    # l = 0: the row saw no key (m = -inf: lse = -inf, o = acc = 0); l NaN: a NaN score (lse, o NaN)
    lse = (m_i + tl.log2(l_i)) / LOG2E
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if HIDDEN_KEYS:
        # the reference's p · v meets the keys hidden from a query with p = 0: an inf or NaN there
        # makes its column NaN (0 · inf); the blocks past `hi` are never loaded, so LAST tells
        offs_d = tl.arange(0, BLOCK_D)
        last = tl.load(LAST + (b * (Hq // GROUP) + hk) * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=-1)
        o = tl.where(last[None, :] > tl.maximum(offs_m + shift, -1)[:, None], float("nan"), o)
    tl.store(LSE + bh * Sq + offs_m, lse, mask=offs_m < Sq)
    _store_rows(OUT + bh * Sq * HEAD_DIM, offs_m, Sq, HEAD_DIM, o, HEAD_DIM, BLOCK_D)


@cached_launch
@triton.jit
def _attn_decode_kernel(
    Q, K, V, OUT, LSE,  # OUT, LSE: with DIRECT as `_attn_fwd_kernel`'s; else float32 partials
    # [B·Hkv, splits, BLOCK_M, BLOCK_D] and [B·Hkv, splits, BLOCK_M] (lse in base 2)
    MASK,  # as `_attn_fwd_kernel`'s
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hkv, GROUP, Sq, Skv, CHUNK,  # CHUNK: keys per split, a multiple of BLOCK_N
    qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DIRECT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    bk = tl.program_id(1).to(tl.int64)
    b = bk // Hkv
    hk = bk % Hkv
    # row r of the tile: query r % Sq of head hk·GROUP + r // Sq (every query of the group's heads)
    r = tl.arange(0, BLOCK_M)
    rows = GROUP * Sq
    offs_m = r % Sq
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * stride_qb + (hk * GROUP + r // Sq)[:, None] * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=(r[:, None] < rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    mask_rows = MASK  # None without a mask
    if HAS_MASK:
        mask_rows = MASK + b * stride_mb + (hk * GROUP + r // Sq) * stride_mh + offs_m * stride_mm

    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, Skv)
    shift = Skv - Sq
    # causal: every query sees the keys up to the shift; past it (the last Sq - 1 keys) each its own
    seen = tl.minimum(tl.maximum(shift + 1, lo), hi) if CAUSAL else hi
    full = lo + (seen - lo) // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                     stride_vd, offs_m, lo, full, qk_scale, shift, Skv, mask_rows, r, rows,
                                     stride_mn, False, CAUSAL, HAS_MASK, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_FP32,
                                     PRECISION)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                     stride_vd, offs_m, full, hi, qk_scale, shift, Skv, mask_rows, r, rows,
                                     stride_mn, True, CAUSAL, HAS_MASK, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_FP32,
                                     PRECISION)
    # the keys hidden from a query lie in the blocks loaded with the mask: a v row with an inf or NaN
    # there reaches o through p = 0 (0 · inf) as in the reference, with no record of v needed
    lse2 = m_i + tl.log2(l_i)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if DIRECT:
        tl.store(LSE + bk * rows + r, lse2 / LOG2E, mask=r < rows)
        _store_rows(OUT + bk * rows * HEAD_DIM, r, rows, HEAD_DIM, o, HEAD_DIM, BLOCK_D)
    else:
        part = bk * tl.num_programs(0) + split
        tl.store(LSE + part * BLOCK_M + r, lse2)
        tl.store(OUT + (part * BLOCK_M + r[:, None]) * BLOCK_D + offs_d[None, :], o)


@cached_launch
@triton.jit
def _attn_decode_combine_kernel(
    PART_O, PART_LSE, OUT, LSE,  # `_attn_decode_kernel`'s partials; OUT, LSE as `_attn_fwd_kernel`'s
    SPLITS,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One output row (query ``r`` of the group ``bk``) from the splits' ``(o, lse)``:
    ``lse = log Σ_s exp(lse_s)``, ``o = Σ_s exp(lse_s − lse) · o_s``."""
    row = tl.program_id(0).to(tl.int64)
    bk = row // ROWS
    r = row % ROWS
    s = tl.arange(0, BLOCK_S)
    part = bk * SPLITS + s
    lse_s = tl.load(PART_LSE + part * BLOCK_M + r, mask=s < SPLITS, other=float("-inf"))
    m = tl.max(lse_s, 0)
    # as in the forward's loop: -inf everywhere (no key seen) gives lse = -inf and o = Σ 0 · o_s;
    # a +inf gives lse = +inf and o = NaN; a NaN stays NaN
    w = tl.exp2(lse_s - tl.where(tl.abs(m) < float("inf"), m, 0.0))
    total = tl.sum(w, 0)
    offs_d = tl.arange(0, BLOCK_D)
    o_s = tl.load(PART_O + (part * BLOCK_M + r)[:, None] * BLOCK_D + offs_d[None, :], mask=(s < SPLITS)[:, None],
                  other=0.0)
    o = tl.sum(w[:, None] * o_s, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(LSE + row, (tl.where(tl.abs(m) < float("inf"), m, 0.0) + tl.log2(total)) / LOG2E)
    tl.store(OUT + row * HEAD_DIM + offs_d, o.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _attn_bwd_delta_kernel(
    OUT, DOUT, DELTA,  # OUT contiguous [B, Hq, Sq, D]; DELTA contiguous [B, Hq, Sq]
    stride_dob, stride_doh, stride_dom, stride_dod,
    Hq, Sq,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(OUT + bh * Sq * HEAD_DIM, offs_m, Sq, HEAD_DIM, 1, HEAD_DIM, BLOCK_D)
    do = _load_rows(DOUT + bh // Hq * stride_dob + bh % Hq * stride_doh, offs_m, Sq, stride_dom, stride_dod,
                    HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * Sq + offs_m, delta, mask=offs_m < Sq)


@triton.jit
def _attn_bwd_dkdv_blocks(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base,
    stride_qm, stride_qd, stride_dom, stride_dod,
    offs_n, lo, hi, qk_scale, shift, Sq, Skv,
    mask_keys, stride_mm,  # with HAS_MASK: each key's column of the head's mask (its query 0)
    MASK: tl.constexpr,  # apply the causal mask (query blocks on the diagonal only)
    HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    # Queries past Sq load as zeros (q = do = 0, δ = 0) and keys past Skv are never stored; a
    # query past Sq still gets p = 0, since a key with an inf would give it a NaN score (inf · 0).
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base, offs_m, Sq, stride_qm, stride_qd, HEAD_DIM, BLOCK_D)
        do = _load_rows(do_base, offs_m, Sq, stride_dom, stride_dod, HEAD_DIM, BLOCK_D)
        lse = tl.load(lse_base + offs_m, mask=offs_m < Sq, other=0.0)
        # a query that saw no key has lse = -inf; +inf makes its p exactly 0
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
        delta = tl.load(delta_base + offs_m, mask=offs_m < Sq, other=0.0)
        pt = tl.exp2(dot(k, tl.trans(q), None, DOT_FP32, PRECISION) * qk_scale - lse[None, :])
        if MASK:
            visible = (offs_n[:, None] <= offs_m[None, :] + shift) & (offs_m < Sq)[None, :]
        else:
            visible = (offs_m < Sq)[None, :]
        if HAS_MASK:
            visible = visible & _load_mask(mask_keys[:, None] + offs_m[None, :] * stride_mm, offs_n, Skv, offs_m,
                                           Sq, True)
        pt = tl.where(visible, pt, 0.0)
        dv = dot(pt.to(do.dtype), do, dv, DOT_FP32, PRECISION)
        dpt = dot(v, tl.trans(do), None, DOT_FP32, PRECISION)
        dk = dot((pt * (dpt - delta[None, :])).to(q.dtype), q, dk, DOT_FP32, PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOUT, LSE, DELTA, DK, DV,  # DK, DV contiguous [B, Hkv, Skv, D]
    MASK,  # as `_attn_fwd_kernel`'s
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hkv, GROUP, Sq, Skv,
    scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // Hkv
    hk = bhk % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_rows(K + b * stride_kb + hk * stride_kh, offs_n, Skv, stride_kn, stride_kd, HEAD_DIM, BLOCK_D)
    v = _load_rows(V + b * stride_vb + hk * stride_vh, offs_n, Skv, stride_vn, stride_vd, HEAD_DIM, BLOCK_D)

    shift = Skv - Sq
    if CAUSAL:
        # from the block of the first query that sees this block's first key, masked up to the
        # first query that sees all of its keys
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        full = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1, Sq + BLOCK_M - 1)
        full = tl.maximum(full // BLOCK_M * BLOCK_M, lo)
    else:
        lo = 0
        full = 0

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        stats = (b * Hkv * GROUP + h) * Sq
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DOUT + b * stride_dob + h * stride_doh
        mask_keys = MASK  # None without a mask
        if HAS_MASK:
            mask_keys = MASK + b * stride_mb + h * stride_mh + offs_n * stride_mn
        dk, dv = _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, LSE + stats, DELTA + stats,
                                       stride_qm, stride_qd, stride_dom, stride_dod,
                                       offs_n, lo, full, qk_scale, shift, Sq, Skv, mask_keys, stride_mm,
                                       True, HAS_MASK, HEAD_DIM, BLOCK_M, BLOCK_D, DOT_FP32, PRECISION)
        dk, dv = _attn_bwd_dkdv_blocks(dk, dv, k, v, q_base, do_base, LSE + stats, DELTA + stats,
                                       stride_qm, stride_qd, stride_dom, stride_dod,
                                       offs_n, full, Sq, qk_scale, shift, Sq, Skv, mask_keys, stride_mm,
                                       False, HAS_MASK, HEAD_DIM, BLOCK_M, BLOCK_D, DOT_FP32, PRECISION)
    _store_rows(DK + bhk * Skv * HEAD_DIM, offs_n, Skv, HEAD_DIM, dk * scale, HEAD_DIM, BLOCK_D)
    _store_rows(DV + bhk * Skv * HEAD_DIM, offs_n, Skv, HEAD_DIM, dv, HEAD_DIM, BLOCK_D)


@triton.jit
def _attn_bwd_dq_blocks(
    dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, lo, hi, qk_scale, shift, Sq, Skv,
    mask_rows, stride_mn,  # with HAS_MASK: each query's row of the head's mask (its key 0)
    MASK: tl.constexpr,  # apply the key-range and causal masks (diagonal and tail blocks only)
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    # keys past Skv load as zeros, but an inf in q makes their score inf · 0 = NaN, whose ds would
    # reach dq through the zero row of k (NaN · 0): their p is masked to 0 like a hidden key's
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, offs_n, Skv, stride_kn, stride_kd, HEAD_DIM, BLOCK_D)
        vt = _load_tile(v_base + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn,
                        offs_d, HEAD_DIM, offs_n, Skv, HEAD_DIM != BLOCK_D, True)
        p = tl.exp2(dot(q, tl.trans(k), None, DOT_FP32, PRECISION) * qk_scale - lse[:, None])
        if MASK:
            visible = offs_n[None, :] < Skv
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
            if HAS_MASK:
                visible = visible & _load_mask(mask_rows[:, None] + offs_n[None, :] * stride_mn, offs_m, Sq,
                                               offs_n, Skv, True)
            p = tl.where(visible, p, 0.0)
        elif HAS_MASK:
            p = tl.where(_load_mask(mask_rows[:, None] + offs_n[None, :] * stride_mn, offs_m, Sq, offs_n, Skv,
                                    False), p, 0.0)
        dp = dot(do, vt, None, DOT_FP32, PRECISION)
        dq = dot((p * (dp - delta[:, None])).to(k.dtype), k, dq, DOT_FP32, PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DOUT, LSE, DELTA, DQ,  # DQ contiguous [B, Hq, Sq, D]
    MASK,  # as `_attn_fwd_kernel`'s
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hq, GROUP, Sq, Skv,
    scale, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, Sq, stride_qm, stride_qd, HEAD_DIM, BLOCK_D)
    do = _load_rows(DOUT + b * stride_dob + h * stride_doh, offs_m, Sq, stride_dom, stride_dod,
                    HEAD_DIM, BLOCK_D)
    lse = tl.load(LSE + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(DELTA + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    mask_rows = MASK  # None without a mask
    if HAS_MASK:
        mask_rows = MASK + b * stride_mb + h * stride_mh + offs_m * stride_mm

    shift = Skv - Sq
    if CAUSAL:
        full, hi = _causal_range(start_m, shift, Skv, BLOCK_M, BLOCK_N)
    else:
        full = Skv // BLOCK_N * BLOCK_N
        hi = Skv

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                             stride_vd, offs_m, 0, full, qk_scale, shift, Sq, Skv, mask_rows, stride_mn,
                             False, CAUSAL, HAS_MASK, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_FP32, PRECISION)
    dq = _attn_bwd_dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                             stride_vd, offs_m, full, hi, qk_scale, shift, Sq, Skv, mask_rows, stride_mn,
                             True, CAUSAL, HAS_MASK, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_FP32, PRECISION)
    _store_rows(DQ + bh * Sq * HEAD_DIM, offs_m, Sq, HEAD_DIM, dq * scale, HEAD_DIM, BLOCK_D)


def _mask_args(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, tuple[int | None, ...]]:
    """The mask as the kernels read it: its bytes (a bool is one byte: the uint8 view keeps the
    strides of the broadcast view core passes, no copy) and its 4 strides; all None without one, so
    that the unmasked kernels compile as if the arguments were not there."""
    if mask is None:
        return None, (None,) * 4
    return mask.view(torch.uint8), mask.stride()


def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None,
    *, tiles: TilesByHeadDim | None = None, fp32_tiles: TilesByHeadDim | None = None,
    decode: Decode = PORTABLE_DECODE, fp32_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(o, lse)``: ``o`` like q (contiguous), ``lse`` float32 ``[B, Hq, Sq]`` (natural log).

    ``mask``: None or bool ``[B, Hq, Sq, Skv]`` (any strides), True where the query may attend the key.
    ``tiles`` and ``fp32_tiles`` override the portable tiles per head dim for 16-bit and float32
    inputs (`kpt_triton.attention_tiles`); ``decode`` how a call whose queries of one KV head fit in
    one tile splits its keys (`_decode`); ``fp32_precision`` is the dot precision for
    float32 inputs ("ieee", or "tf32" where a backend accepts its error).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    o = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    block_d, t = attention_tiles.launch_tiles(D, q.dtype, tiles, fp32_tiles, False, mask is not None,
                                              attention_tiles.shared_memory(q.device))
    if _decodes(q, k, block_d, t, decode):
        return _decode(q, k, v, mask, o, lse, causal, scale, block_d, t, decode,
                       dot_precision(q.dtype, fp32_precision))
    # with a causal mask and more than one query, some keys are hidden from some queries
    last = torch.empty((B, Hkv, D), dtype=torch.int32, device=q.device) if causal and Sq > 1 else None
    if last is not None:
        if Skv > 0:
            _last_nonfinite_kernel[(B * Hkv,)](v, last, *v.stride(), Hkv, Skv, HEAD_DIM=D, BLOCK_N=t.block_n,
                                               BLOCK_D=block_d, num_warps=t.num_warps)
        else:
            last.fill_(-1)
    m, m_strides = _mask_args(mask)
    _attn_fwd_kernel[(cdiv(Sq, t.block_m), B * Hq)](
        q, k, v, o, lse, last, m,
        *q.stride(), *k.stride(), *v.stride(), *m_strides,
        Hq, Hq // Hkv, Sq, Skv, scale * _LOG2E,
        CAUSAL=causal, HEAD_DIM=D, HIDDEN_KEYS=last is not None, HAS_MASK=mask is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d,
        DOT_FP32=DOT_FP32, PRECISION=dot_precision(q.dtype, fp32_precision),
        num_warps=t.num_warps, num_stages=t.num_stages, **t.options,
    )
    return o, lse


def decodes(q: torch.Tensor, k: torch.Tensor, tiles: TilesByHeadDim | None = None,
            plan: Decode = PORTABLE_DECODE, fp32_tiles: TilesByHeadDim | None = None, masked: bool = False) -> bool:
    """Whether `attention_fwd` runs the call (with a mask where ``masked``) with the decode kernel: keys
    to read, and few queries of one KV head (its group's query heads × Sq; `Decode`)."""
    block_d, t = attention_tiles.launch_tiles(q.shape[3], q.dtype, tiles, fp32_tiles, False, masked,
                                              attention_tiles.shared_memory(q.device))
    return _decodes(q, k, block_d, t, plan)


def _decodes(q: torch.Tensor, k: torch.Tensor, block_d: int, tiles: Tiles, plan: Decode) -> bool:
    """`decodes`, given the padded head dim and the forward's tiles."""
    _, Hkv, Skv, _ = k.shape
    return Skv > 0 and q.shape[1] // Hkv * q.shape[2] <= attention_tiles.decode_rows(q.dtype, block_d, tiles, plan)


def _decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, o: torch.Tensor,
    lse: torch.Tensor, causal: bool, scale: float, block_d: int, tiles: Tiles, plan: Decode, precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding (flash-decoding): one program per KV head and chunk of keys takes every query of
    the heads sharing that KV head in one tile, so each key and value is read once per KV head,
    not once per query head, and a long cache is split over the multiprocessors. With more than
    one chunk, each writes its ``(o, lse)`` in float32 and `_attn_decode_combine_kernel` merges them."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    rows = Hq // Hkv * Sq
    block_m, block_n, num_warps, num_stages = attention_tiles.decode_tiles(
        rows, block_d, q.dtype, tiles, plan, mask is not None, attention_tiles.shared_memory(q.device))
    plan = plan if attention_tiles.planned(q.dtype, block_d) else PORTABLE_DECODE
    wave = tiling.multiprocessor_count(q.device) * plan.programs_per_sm // (B * Hkv)
    splits = max(1, min(wave, cdiv(Skv, plan.split_keys), attention_tiles.MAX_SPLITS))
    chunk = cdiv(cdiv(Skv, splits), block_n) * block_n
    splits = cdiv(Skv, chunk)
    direct = splits == 1
    if direct:
        out, out_lse = o, lse
    else:
        out = torch.empty((B * Hkv, splits, block_m, block_d), dtype=torch.float32, device=q.device)
        out_lse = torch.empty((B * Hkv, splits, block_m), dtype=torch.float32, device=q.device)
    m, m_strides = _mask_args(mask)
    _attn_decode_kernel[(splits, B * Hkv)](
        q, k, v, out, out_lse, m, *q.stride(), *k.stride(), *v.stride(), *m_strides,
        Hkv, Hq // Hkv, Sq, Skv, chunk, scale * _LOG2E,
        CAUSAL=causal, HAS_MASK=mask is not None, DIRECT=direct, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_FP32=DOT_FP32, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages, **tiles.options,
    )
    if not direct:
        _attn_decode_combine_kernel[(B * Hkv * rows,)](
            out, out_lse, o, lse, splits,
            ROWS=rows, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=next_pow2(splits),
        )
    return o, lse


def attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None,
    o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor | None,
    *, tiles: TilesByHeadDim | None = None, fp32_tiles: TilesByHeadDim | None = None, fp32_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv)`` like q, k, v; zeros when ``do`` is None.

    ``tiles`` and ``fp32_tiles`` (per head dim, as for `attention_fwd`) are those of all three backward kernels:
    ``block_m`` queries and ``block_n`` keys.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    new = torch.zeros if do is None else torch.empty
    dq = new((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    dk = new((B, Hkv, Skv, D), dtype=k.dtype, device=k.device)
    dv = new((B, Hkv, Skv, D), dtype=v.dtype, device=v.device)
    if do is None:
        return dq, dk, dv
    block_d, t = attention_tiles.launch_tiles(D, q.dtype, tiles, fp32_tiles, True, mask is not None,
                                              attention_tiles.shared_memory(q.device))
    common = {"CAUSAL": causal, "HAS_MASK": mask is not None, "HEAD_DIM": D, "BLOCK_M": t.block_m,
              "BLOCK_N": t.block_n, "BLOCK_D": block_d,
              "DOT_FP32": DOT_FP32, "PRECISION": dot_precision(q.dtype, fp32_precision),
              "num_warps": t.num_warps, "num_stages": t.num_stages, **t.options}
    delta = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    m, m_strides = _mask_args(mask)
    if dq.numel() > 0:
        _attn_bwd_delta_kernel[(cdiv(Sq, t.block_m), B * Hq)](
            o, do, delta, *do.stride(), Hq, Sq,
            HEAD_DIM=D, BLOCK_M=t.block_m, BLOCK_D=block_d, num_warps=t.num_warps, **t.options,
        )
        _attn_bwd_dq_kernel[(cdiv(Sq, t.block_m), B * Hq)](
            q, k, v, do, lse, delta, dq, m,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *m_strides,
            Hq, Hq // Hkv, Sq, Skv, scale, scale * _LOG2E, **common,
        )
    if dk.numel() > 0:
        _attn_bwd_dkdv_kernel[(cdiv(Skv, t.block_n), B * Hkv)](
            q, k, v, do, lse, delta, dk, dv, m,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *m_strides,
            Hkv, Hq // Hkv, Sq, Skv, scale, scale * _LOG2E, **common,
        )
    return dq, dk, dv
