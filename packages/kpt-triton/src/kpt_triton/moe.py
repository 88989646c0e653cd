"""Mixture of experts: routing, permutation, per-expert matmul and weighted un-permutation.

A token t picks k of E experts; pair ``t·k + slot`` names one of its choices.

Gating, one program per block of tokens, the whole row of E logits in registers::

    p = softmax(logits[t]) (float32);  k times: the largest remaining logit, lowest index on ties
    weights = p[chosen]  (/ Σ p[chosen] with renormalize: exp(l − m) / Σ_chosen exp(l − m))
    dlogits = scatter(w ∘ (dw − Σ dw·w))          renormalize (a softmax over the chosen logits)
            = p ∘ (dp − Σ dp·p),  dp = scatter(dw) otherwise

Dispatch is a stable counting sort of the ``T·k`` pairs by expert, with no host sync; a pair whose
expert is outside ``[0, E)`` counts as expert E, so it sorts after every expert's rows:

    counts[e, b] = pairs of block b routed to e        (one program per block of pairs, e <= E)
    before[e, b] = exclusive cumsum of counts, expert-major = offsets[e] + Σ_{b' < b} counts[e, b']
    row of pair  = before[e, b] + (earlier pairs of block b routed to e)
    x_sorted[row] = x[pair // k],  order[row] = pair

Pairs that fit one block (a decode step) skip the counts: one launch whose every program ranks all
the pairs (row of pair = pairs of lower experts + earlier pairs of its expert) and copies a slice
of the columns.

``grouped_linear`` is one Triton grouped GEMM over E + 2 segments of rows: the rows before the
first expert's, the E experts', and the rows after the last expert's (the outer two get zeros),
with bounds from `kpt.kernels.moe.expert_bounds` (offsets clamped to the rows and made
non-decreasing on the device, so bad offsets can neither overlap experts nor leave the tensor). The
row tiles of all segments are numbered on the device (segment s owns ``cdiv(rows_s, BLOCK_M)``
consecutive tiles), the grid covers the upper bound ``cdiv(M, BLOCK_M) + E + 2`` tiles, and a
program past the last tile exits, so expert sizes are never read on the host.
``dweight[e] = dy[rows of e]ᵀ · x[rows of e]`` has one program per expert and output tile,
looping over the expert's rows.

Combine and the dispatch backward gather each token's k rows through the inverse permutation
(``row of pair = inverse[pair]``) and sum them, so no two programs write one row. The inverse starts
at -1 (a pair no row names reads nothing); ``order`` values outside ``[0, T·k)`` are skipped, and
where rows name one pair the last row wins (an atomic maximum: deterministic); an order of at most
``ONE_BLOCK`` rows (a decode step's) is inverted by every program itself, with the same result,
so that combine and the dispatch backward are one launch each there (the combine backward two:
column tiles, then their shares of each dweight summed in tile order). The combine
backward walks the sorted rows: where ``r = inverse[pair]``, ``dy_sorted[r] = w[pair] · dy[t]``
and ``dweights[pair] = dy[t] · y_sorted[r]``; other rows get 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kpt.kernels.moe import expert_bounds

from .launch import cached_launch
from .linear import DOT_FP32, dot, dot_precision
from .tiling import cdiv, next_pow2, vector


@triton.jit
def _order_bits(bits, BITS: tl.constexpr):
    """Signed ``BITS``-bit float bits → integers ordered like the floats (−0 taken as +0, so
    that the two tie); the map is its own inverse on the result."""
    bits = tl.where(bits == -(1 << (BITS - 1)), 0, bits)
    return bits ^ ((bits >> (BITS - 1)) & ((1 << (BITS - 1)) - 1))


@cached_launch
@triton.jit
def _moe_gating_fwd_kernel(
    LOGITS, WEIGHTS, INDICES,  # WEIGHTS float32 and INDICES int32 are contiguous [T, K]
    T, E, stride_lt, stride_le,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    raw = tl.load(LOGITS + rows[:, None].to(tl.int64) * stride_lt + cols[None, :] * stride_le,
                  mask=valid, other=float("-inf"))
    logits = raw.to(tl.float32)
    # padded rows (all -inf) get m = 0 and a unit denominator, so they stay NaN-free
    m = tl.where(row_ok, tl.max(logits, 1), 0.0)
    denom = tl.where(row_ok, tl.sum(tl.exp(logits - m[:, None]), 1), 1.0)

    # Selection by logit (softmax is monotonic, and logits separate what rounds to equal
    # probabilities) through one integer key per logit: its order bits above the bits of
    # BLOCK_E - 1 - column, so that one max per slot finds the largest logit, lowest column on
    # ties, and gives both back. 16-bit logits fit with their column in 32 bits, float32 in 64.
    low = BLOCK_E - 1 - cols[None, :]
    if WIDE:
        key = (_order_bits(logits.to(tl.int32, bitcast=True), 32).to(tl.int64) << 32) | low
    else:
        key = (_order_bits(raw.to(tl.int16, bitcast=True).to(tl.int32), 16) << 16) | low
    taken = tl.full([BLOCK_T, BLOCK_E], -(1 << 63) if WIDE else -(1 << 31), key.dtype)
    key = tl.where(valid, key, taken)
    top = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_idx = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for s in range(K):
        best = tl.max(key, 1)
        key = tl.where(key == best[:, None], taken, key)
        idx = (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32)
        if WIDE:
            value = _order_bits((best >> 32).to(tl.int32), 32).to(tl.float32, bitcast=True)
        else:
            bits = _order_bits(best >> 16, 16).to(tl.int16)
            value = bits.to(LOGITS.dtype.element_ty, bitcast=True).to(tl.float32)
        top = tl.where(kcols[None, :] == s, tl.exp(value - m)[:, None], top)
        top_idx = tl.where(kcols[None, :] == s, idx[:, None], top_idx)
    if RENORMALIZE:
        top = top / tl.where(row_ok, tl.sum(top, 1), 1.0)[:, None]
    else:
        top = top / denom[:, None]
    out = rows[:, None].to(tl.int64) * K + kcols[None, :]
    keep = row_ok[:, None] & (kcols[None, :] < K)
    tl.store(WEIGHTS + out, top, mask=keep)
    tl.store(INDICES + out, top_idx, mask=keep)


@cached_launch
@triton.jit
def _moe_gating_bwd_kernel(
    LOGITS, WEIGHTS, INDICES, DW, DLOGITS,  # WEIGHTS, INDICES contiguous [T, K]; DLOGITS contiguous [T, E]
    T, E, stride_lt, stride_le, stride_dwt, stride_dwk,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    # Σ_slot w·dw, one slot at a time: each thread sums its own rows (a reduction of a [rows, K]
    # tile would go through shared memory, where threads holding copies of a narrow K write the
    # same words: a write-write hazard for compute-sanitizer's racecheck)
    w_dot_dw = tl.zeros([BLOCK_T], dtype=tl.float32)
    for s in range(K):
        w = tl.load(WEIGHTS + rows64 * K + s, mask=row_ok, other=0.0)
        dw = tl.load(DW + rows64 * stride_dwt + s * stride_dwk, mask=row_ok, other=0.0)
        w_dot_dw += w * dw.to(tl.float32)

    # scatter the slots' gradients into their expert columns
    dsel = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for s in range(K):
        idx = tl.load(INDICES + rows64 * K + s, mask=row_ok, other=-1)
        g = tl.load(DW + rows64 * stride_dwt + s * stride_dwk, mask=row_ok, other=0.0).to(tl.float32)
        if RENORMALIZE:
            g = tl.load(WEIGHTS + rows64 * K + s, mask=row_ok, other=0.0) * (g - w_dot_dw)
        dsel += tl.where(cols[None, :] == idx[:, None], g[:, None], 0.0)

    col_ok = row_ok[:, None] & (cols[None, :] < E)
    if RENORMALIZE:
        dlogits = dsel
    else:
        logits = tl.load(LOGITS + rows64[:, None] * stride_lt + cols[None, :] * stride_le,
                         mask=col_ok, other=float("-inf")).to(tl.float32)
        m = tl.where(row_ok, tl.max(logits, 1), 0.0)
        e = tl.exp(logits - m[:, None])
        p = e / tl.where(row_ok, tl.sum(e, 1), 1.0)[:, None]
        # Σ_e dp·p over the chosen experts is Σ_slot dw·w, since w = p[chosen]
        dlogits = p * (dsel - w_dot_dw[:, None])
    tl.store(DLOGITS + rows64[:, None] * E + cols[None, :], dlogits.to(DLOGITS.dtype.element_ty), mask=col_ok)


@triton.jit
def _expert_of_pair(INDICES, pairs, ok, E, K, stride_it, stride_ik):
    """The expert of each pair, E for one outside [0, E); -1 where not ``ok``."""
    token = (pairs // K).to(tl.int64)
    expert = tl.load(INDICES + token * stride_it + (pairs % K) * stride_ik, mask=ok, other=-1)
    return tl.where(ok & ((expert < 0) | (expert >= E)), E, expert)


@cached_launch
@triton.jit
def _moe_count_kernel(
    INDICES, COUNTS,  # COUNTS int32 [E + 1, num_blocks], expert-major (row E: pairs out of range)
    P, E, K, num_blocks, stride_it, stride_ik,
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    pairs = b * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = pairs < P
    expert = _expert_of_pair(INDICES, pairs, ok, E, K, stride_it, stride_ik)
    for e0 in range(0, E + 1, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        counts = tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), 0)
        tl.store(COUNTS + experts.to(tl.int64) * num_blocks + b, counts, mask=experts <= E)


@cached_launch
@triton.jit
def _moe_scatter_kernel(
    X, INDICES, COUNTS, CUMSUM, X_SORTED, ORDER, OFFSETS,  # X_SORTED contiguous [P, H]
    P, E, K, H, num_blocks, stride_xt, stride_xh, stride_it, stride_ik,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_P)
    pairs = b * BLOCK_P + lanes
    ok = pairs < P
    token = pairs // K
    expert = _expert_of_pair(INDICES, pairs, ok, E, K, stride_it, stride_ik)
    # stability: a pair goes after the earlier pairs of its block with the same expert
    earlier = (expert[:, None] == expert[None, :]) & (lanes[None, :] < lanes[:, None])
    at = expert.to(tl.int64) * num_blocks + b
    row = tl.load(CUMSUM + at, mask=ok, other=0) - tl.load(COUNTS + at, mask=ok, other=0)
    row = row + tl.sum(earlier.to(tl.int32), 1)
    tl.store(ORDER + row, pairs, mask=ok)
    row64 = row.to(tl.int64)
    token64 = token.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = ok[:, None] & (cols[None, :] < H)
        v = tl.load(X + token64[:, None] * stride_xt + cols[None, :] * stride_xh, mask=mask)
        tl.store(X_SORTED + row64[:, None] * H + cols[None, :], v, mask=mask)
    if b == 0:
        # an expert's first row is the exclusive cumsum at its block 0; that of "expert" E (the
        # pairs out of range) is offsets[E], the number of routed pairs
        for e0 in range(0, E + 1, BLOCK_E):
            experts = e0 + tl.arange(0, BLOCK_E)
            e_ok = experts <= E
            at0 = experts.to(tl.int64) * num_blocks
            first = tl.load(CUMSUM + at0, mask=e_ok) - tl.load(COUNTS + at0, mask=e_ok)
            tl.store(OFFSETS + experts, first, mask=e_ok)


@cached_launch
@triton.jit
def _moe_dispatch_one_block_kernel(
    X, INDICES, X_SORTED, ORDER, OFFSETS,  # X_SORTED contiguous [P, H]
    P, E, K, H, stride_xt, stride_xh, stride_it, stride_ik,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Dispatch of pairs that fit one block (a decode step) in one launch: every program ranks all
    pairs itself (a pair's row: the pairs of lower experts, then the earlier pairs of its own) and
    copies columns ``[program · BLOCK_H, +BLOCK_H)`` of their rows; program 0 writes ``order`` and
    ``offsets``."""
    lanes = tl.arange(0, BLOCK_P)
    ok = lanes < P
    expert = _expert_of_pair(INDICES, lanes, ok, E, K, stride_it, stride_ik)
    mine, other = expert[:, None], expert[None, :]
    before = ok[None, :] & ((other < mine) | ((other == mine) & (lanes[None, :] < lanes[:, None])))
    row = tl.sum(before.to(tl.int32), 1).to(tl.int64)
    token = (lanes // K).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = ok[:, None] & (cols[None, :] < H)
    v = tl.load(X + token[:, None] * stride_xt + cols[None, :] * stride_xh, mask=mask)
    tl.store(X_SORTED + row[:, None] * H + cols[None, :], v, mask=mask)
    if tl.program_id(0) == 0:
        tl.store(ORDER + row, lanes, mask=ok)
        # an expert's first row is the count of pairs of lower experts; "expert" E's (the pairs out
        # of range) is the number of routed pairs
        for e0 in range(0, E + 1, BLOCK_E):
            experts = e0 + tl.arange(0, BLOCK_E)
            first = tl.sum((ok[:, None] & (expert[:, None] < experts[None, :])).to(tl.int32), 0)
            tl.store(OFFSETS + experts, first, mask=experts <= E)


@cached_launch
@triton.jit
def _invert_kernel(ORDER, INVERSE, P, BLOCK: tl.constexpr):  # INVERSE int32 [P], filled with -1
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < P
    pairs = tl.load(ORDER + rows, mask=ok, other=-1)
    tl.atomic_max(INVERSE + pairs, rows, mask=ok & (pairs >= 0) & (pairs < P))


@triton.jit
def _inverse_of(ORDER, pairs, P, BLOCK_P: tl.constexpr):
    """``inverse[pairs]`` from all ``P <= BLOCK_P`` entries of ORDER at once: the last row naming
    each pair, -1 for none (what `_invert_kernel` leaves), for orders that fit one block."""
    r = tl.arange(0, BLOCK_P)
    named = tl.load(ORDER + r, mask=r < P, other=-1)
    named = tl.where((named >= 0) & (named < P), named, -1)  # values outside [0, P) name no pair
    hit = (named[None, :] == pairs[:, None]) & (pairs[:, None] >= 0)
    return tl.max(tl.where(hit, r[None, :], -1), axis=1)


@cached_launch
@triton.jit
def _gather_sum_kernel(
    SRC, INVERSE, W, OUT,  # OUT contiguous [T, H]; W only with HAS_WEIGHTS; INVERSE is ORDER with INVERT
    T, K, H, P, stride_sr, stride_sh, stride_wt, stride_wk,
    HAS_WEIGHTS: tl.constexpr, INVERT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,  # with INVERT: ≥ the P rows of ORDER, whose inverse each program computes
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = tokens < T
    mask = t_ok[:, None] & (cols[None, :] < H)
    tokens64 = tokens.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for s in range(K):
        if INVERT:
            row = tl.where(t_ok, _inverse_of(INVERSE, tokens * K + s, P, BLOCK_P), -1).to(tl.int64)
        else:
            row = tl.load(INVERSE + tokens64 * K + s, mask=t_ok, other=-1).to(tl.int64)
        v = tl.load(SRC + row[:, None] * stride_sr + cols[None, :] * stride_sh, mask=mask & (row[:, None] >= 0),
                    other=0.0)
        if HAS_WEIGHTS:
            w = tl.load(W + tokens64 * stride_wt + s * stride_wk, mask=t_ok, other=0.0)
            acc += v.to(tl.float32) * w.to(tl.float32)[:, None]
        else:
            acc += v.to(tl.float32)
    tl.store(OUT + tokens64[:, None] * H + cols[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _moe_combine_bwd_kernel(
    Y_SORTED, ORDER, INVERSE, W, DY, DY_SORTED, DW, PART,  # DY_SORTED contiguous [P, H], DW contiguous [T, K]
    P, K, H, stride_yr, stride_yh, stride_wt, stride_wk, stride_dyt, stride_dyh,
    # all P rows fit BLOCK_P: each program computes the inverse (INVERSE unused) and takes one column
    # tile (program_id(1)), whose share of each row's dweight goes to PART [tiles, P] instead of DW
    INVERT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < P
    pair = tl.load(ORDER + rows, mask=ok, other=-1)
    named = ok & (pair >= 0) & (pair < P)
    # the forward read this row for its pair only where the inverse points back to it
    if INVERT:
        read = named & (_inverse_of(ORDER, pair, P, BLOCK_P) == rows)
        h_lo = tl.program_id(1) * BLOCK_H
        h_hi = tl.minimum(h_lo + BLOCK_H, H)
    else:
        read = named & (tl.load(INVERSE + pair, mask=named, other=-1) == rows)
        h_lo = 0
        h_hi = H
    token = (pair // K).to(tl.int64)
    w = tl.load(W + token * stride_wt + (pair % K) * stride_wk, mask=read, other=0.0).to(tl.float32)
    rows64 = rows.to(tl.int64)
    # products summed elementwise over the column tiles and reduced across the row once, after
    # the loop (a reduction inside the loop reused its shared-memory scratch on every tile, where
    # compute-sanitizer's racecheck reported write-after-write hazards on an H100)
    gy = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for h0 in range(h_lo, h_hi, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = ok[:, None] & (cols[None, :] < H)
        g = tl.load(DY + token[:, None] * stride_dyt + cols[None, :] * stride_dyh, mask=mask & read[:, None],
                    other=0.0)
        y = tl.load(Y_SORTED + rows64[:, None] * stride_yr + cols[None, :] * stride_yh, mask=mask, other=0.0)
        g = g.to(tl.float32)
        gy += g * y.to(tl.float32)
        dy_sorted = (g * w[:, None]).to(DY_SORTED.dtype.element_ty)
        tl.store(DY_SORTED + rows64[:, None] * H + cols[None, :], dy_sorted, mask=mask)
    if INVERT:
        tl.store(PART + tl.program_id(1) * P + rows, tl.sum(gy, 1), mask=ok)
    else:
        tl.store(DW + pair, tl.sum(gy, 1).to(DW.dtype.element_ty), mask=read)


@cached_launch
@triton.jit
def _combine_dweights_kernel(PART, ORDER, DW, P, TILES, BLOCK_P: tl.constexpr):
    """One program: the dweights of an order of at most ``BLOCK_P`` rows from the column tiles'
    shares in ``PART [TILES, P]`` (by row), summed in tile order: each pair's from the row the
    forward read for it, 0 for a pair that no row names."""
    every = tl.arange(0, BLOCK_P)
    row = _inverse_of(ORDER, every, P, BLOCK_P)
    has = (every < P) & (row >= 0)
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for t in range(0, TILES):
        acc += tl.load(PART + t * P + row, mask=has, other=0.0)
    tl.store(DW + every, acc.to(DW.dtype.element_ty), mask=every < P)


@cached_launch
@triton.jit
def _grouped_mm_kernel(
    A, B, C, BOUNDS,  # C contiguous [M, N]; segment s owns rows BOUNDS[s]:BOUNDS[s+1] of A and C
    N, K, S,  # S = E + 2 segments: no expert, experts 0..E-1 (segment e + 1), no expert
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,  # B[e] read as a [K, N] matrix
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tile = pid // num_n
    pid_n = pid % num_n

    # number the row tiles of all segments and find the segment that owns this one
    segments = tl.arange(0, BLOCK_S)
    lo = tl.load(BOUNDS + segments, mask=segments < S, other=0)
    hi = tl.load(BOUNDS + segments + 1, mask=segments < S, other=0)
    tiles_end = tl.cumsum((hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    s = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    if s < S:
        mine = segments == s
        first_tile = tl.sum(tl.where(mine, tiles_end - (hi - lo + BLOCK_M - 1) // BLOCK_M, 0), 0)
        row_end = tl.sum(tl.where(mine, hi, 0), 0)
        rows = tl.sum(tl.where(mine, lo, 0), 0) + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if (s > 0) & (s < S - 1):
            b_base = B + (s - 1).to(tl.int64) * stride_be
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(A + rows64[:, None] * stride_am + ks[None, :] * stride_ak,
                            mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
                b = tl.load(b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                            mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
                acc = dot(a, b, acc, DOT_FP32, PRECISION)
        tl.store(C + rows64[:, None] * N + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] < N))


@cached_launch
@triton.jit
def _grouped_wgrad_kernel(
    DY, X, DW, OFFSETS,  # DW contiguous [E, N, K]
    N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    e = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    ns = tl.program_id(1) // num_k * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) % num_k * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(OFFSETS + e)
    end = tl.load(OFFSETS + e + 1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        dyt = tl.load(DY + rows[None, :] * stride_dym + ns[:, None] * stride_dyn,
                      mask=row_ok[None, :] & (ns[:, None] < N), other=0.0)
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        acc = dot(dyt, x, acc, DOT_FP32, PRECISION)
    out = DW + e.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=(ns[:, None] < N) & (ks[None, :] < K))


def _row_block(width: int, tile_elems: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_W)``: whole rows of ``width`` columns, about ``tile_elems`` per program."""
    block_w = next_pow2(width)
    return max(1, tile_elems // block_w), block_w


def moe_gating_fwd(
    logits: torch.Tensor, k: int, renormalize: bool, *, tile_elems: int = 2048, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(weights float32 [T, k], indices int32 [T, k])``; ``tile_elems`` logits per program."""
    T, E = logits.shape
    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    indices = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, indices
    block_t, block_e = _row_block(E, tile_elems)
    _moe_gating_fwd_kernel[(cdiv(T, block_t),)](
        logits, weights, indices, T, E, *logits.stride(),
        K=k, RENORMALIZE=renormalize, WIDE=logits.element_size() > 2,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_pow2(k), num_warps=num_warps,
    )
    return weights, indices


def moe_gating_bwd(
    logits: torch.Tensor, k: int, renormalize: bool, weights: torch.Tensor, indices: torch.Tensor,
    dweights: torch.Tensor | None, dindices: torch.Tensor | None,
    *, tile_elems: int = 2048, num_warps: int = 4,
) -> tuple[torch.Tensor]:
    """Returns ``(dlogits,)`` like logits; zeros when ``dweights`` is None."""
    T, E = logits.shape
    if dweights is None:
        return (torch.zeros((T, E), dtype=logits.dtype, device=logits.device),)
    dlogits = torch.empty((T, E), dtype=logits.dtype, device=logits.device)
    if T == 0:
        return (dlogits,)
    block_t, block_e = _row_block(E, tile_elems)
    _moe_gating_bwd_kernel[(cdiv(T, block_t),)](
        logits, weights, indices, dweights, dlogits, T, E, *logits.stride(), *dweights.stride(),
        K=k, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
    )
    return (dlogits,)


ONE_BLOCK = 128
"""Pairs (rows of an order) up to this many are a decode step's: dispatch ranks them, and combine,
its backward and the dispatch backward invert the order, inside their own kernels (a ``ONE_BLOCK²``
comparison per program) instead of in launches of their own."""


def moe_dispatch_fwd(
    x: torch.Tensor, indices: torch.Tensor, num_experts: int,
    *, block_pairs: int = ONE_BLOCK, block_h: int = 64, block_e: int = 128, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(x_sorted [T·k, H], offsets int32 [E+1], order int32 [T·k])`` without a host sync.

    ``block_pairs`` pairs per program (the in-block ranking costs ``block_pairs²`` compares); pairs
    that fit one block take one launch (`_moe_dispatch_one_block_kernel`), more take three.
    ``block_h`` columns of the rows are copied a step: with 128 pairs, 256 spilled 392-1768 bytes a
    thread on sm90 (AOT check), 64 none.
    """
    T, k = indices.shape
    H = x.shape[1]
    P = T * k
    x_sorted = torch.empty((P, H), dtype=x.dtype, device=x.device)
    order = torch.empty(P, dtype=torch.int32, device=x.device)
    if P == 0:
        return x_sorted, torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device), order
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=x.device)
    num_blocks = cdiv(P, block_pairs)
    block_e = min(block_e, next_pow2(num_experts + 1))
    if num_blocks == 1:
        block_h = min(block_h, next_pow2(H))
        _moe_dispatch_one_block_kernel[(max(cdiv(H, block_h), 1),)](  # program 0 even for H = 0
            x, indices, x_sorted, order, offsets, P, num_experts, k, H, *x.stride(), *indices.stride(),
            BLOCK_P=next_pow2(P), BLOCK_H=block_h, BLOCK_E=block_e, num_warps=num_warps,
        )
        return x_sorted, offsets, order
    counts = torch.empty((num_experts + 1, num_blocks), dtype=torch.int32, device=x.device)
    _moe_count_kernel[(num_blocks,)](
        indices, counts, P, num_experts, k, num_blocks, *indices.stride(),
        BLOCK_P=block_pairs, BLOCK_E=block_e, num_warps=num_warps,
    )
    cumsum = counts.view(-1).cumsum(0, dtype=torch.int32)
    _moe_scatter_kernel[(num_blocks,)](
        x, indices, counts, cumsum, x_sorted, order, offsets,
        P, num_experts, k, H, num_blocks, *x.stride(), *indices.stride(),
        BLOCK_P=block_pairs, BLOCK_H=min(block_h, next_pow2(H)), BLOCK_E=block_e,
        num_warps=num_warps,
    )
    return x_sorted, offsets, order


def _inverse(order: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """``inverse[order[r]] = r``: the sorted row of every pair (-1 for none, the last of several)."""
    order = vector(order)
    inverse = torch.full_like(order, -1)
    if order.numel():
        _invert_kernel[(cdiv(order.numel(), block),)](order, inverse, order.numel(), BLOCK=block)
    return inverse


def _gather_sum(src: torch.Tensor, order: torch.Tensor, weights: torch.Tensor | None, tokens: int, k: int,
                out_dtype: torch.dtype, *, block_t: int, block_h: int, num_warps: int,
                one_block: int = ONE_BLOCK) -> torch.Tensor:
    """``out[t] = Σ_slot weights[t, slot] · src[row of pair t·k + slot]`` (weights 1 when None);
    an order of at most ``one_block`` rows is inverted inside the kernel (one launch)."""
    H = src.shape[1]
    out = torch.empty((tokens, H), dtype=out_dtype, device=src.device)
    if out.numel() == 0:
        return out
    block_h = min(block_h, next_pow2(H))
    w_strides = weights.stride() if weights is not None else (0, 0)
    order = vector(order)
    P = order.numel()
    invert = P <= one_block
    _gather_sum_kernel[(cdiv(tokens, block_t), cdiv(H, block_h))](
        src, order if invert else _inverse(order), weights, out, tokens, k, H, P, *src.stride(), *w_strides,
        HAS_WEIGHTS=weights is not None, INVERT=invert, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_P=next_pow2(P) if invert else 1, num_warps=num_warps,
    )
    return out


def moe_dispatch_bwd(
    x: torch.Tensor, indices: torch.Tensor, num_experts: int,
    x_sorted: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor,
    dx_sorted: torch.Tensor | None, doffsets: torch.Tensor | None, dorder: torch.Tensor | None,
    *, block_t: int = 16, block_h: int = 256, num_warps: int = 4, one_block: int = ONE_BLOCK,
) -> tuple[torch.Tensor]:
    """Returns ``(dx,)``: each token sums the gradients of its k copies (zeros without a gradient)."""
    T, k = indices.shape
    if dx_sorted is None:
        return (torch.zeros((T, x.shape[1]), dtype=x.dtype, device=x.device),)
    return (_gather_sum(dx_sorted, order, None, T, k, x.dtype, block_t=block_t, block_h=block_h,
                        num_warps=num_warps, one_block=one_block),)


def moe_combine_fwd(
    y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
    *, block_t: int = 16, block_h: int = 256, num_warps: int = 4, one_block: int = ONE_BLOCK,
) -> tuple[torch.Tensor]:
    """Returns ``(y [T, H],)`` in y_sorted's dtype, float32 accumulation."""
    T, k = weights.shape
    return (_gather_sum(y_sorted, order, weights, T, k, y_sorted.dtype, block_t=block_t, block_h=block_h,
                        num_warps=num_warps, one_block=one_block),)


def moe_combine_bwd(
    y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
    y: torch.Tensor, dy: torch.Tensor | None,
    *, block_r: int = 16, block_h: int = 256, num_warps: int = 4, one_block: int = ONE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(dy_sorted, dweights)`` like y_sorted and weights; zeros without a gradient. An
    order of at most ``one_block`` rows is inverted inside the kernels (no inverse launch)."""
    P, H = y_sorted.shape
    T, k = weights.shape
    invert = dy is not None and 0 < P <= one_block
    # dweights of a pair that no row names are 0 (with ``invert`` `_combine_dweights_kernel` writes them)
    dweights = (torch.empty if invert else torch.zeros)((T, k), dtype=weights.dtype, device=weights.device)
    dy_sorted = (torch.zeros if dy is None else torch.empty)((P, H), dtype=y_sorted.dtype, device=y_sorted.device)
    if dy is None or P == 0:
        return dy_sorted, dweights
    order = vector(order)
    block_h = min(block_h, next_pow2(H))
    if invert:
        # a decode step's few rows: one program per row block and column tile, then one to sum the
        # tiles' shares of each dweight (on an H100, 8 rows of 7168: 11.1 µs looping over the
        # columns in one program, 4.2 in 2-D; benchmarks/h100-2026-11-27b.md)
        tiles = max(cdiv(H, block_h), 1)
        part = torch.empty(tiles, P, dtype=torch.float32, device=y_sorted.device)
        grid: tuple[int, ...] = (cdiv(P, block_r), tiles)
    else:
        part, grid = dweights, (cdiv(P, block_r),)
    _moe_combine_bwd_kernel[grid](
        y_sorted, order, order if invert else _inverse(order), weights, dy, dy_sorted, dweights, part, P, k, H,
        *y_sorted.stride(), *weights.stride(), *dy.stride(), INVERT=invert,
        BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_P=next_pow2(P) if invert else 1, num_warps=num_warps,
    )
    if invert:
        _combine_dweights_kernel[(1,)](part, order, dweights, P, tiles, BLOCK_P=next_pow2(P))
    return dy_sorted, dweights


def _segments(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 ``[E + 3]``: ``0``, the offsets as the contract reads them (`expert_bounds`), ``rows``;
    computed on the device."""
    # pads, not a tensor from host values: no copy to the device, so CUDA graphs can capture it
    return F.pad(F.pad(expert_bounds(offsets, rows), (1, 0), value=0), (0, 1), value=rows)


def _grouped_mm(
    a: torch.Tensor, bounds: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int], n: int,
    *, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, fp32_precision: str,
) -> torch.Tensor:
    """``c[rows of e] = a[rows of e] · B[e]`` where ``B[e]`` is ``b`` read with ``(expert, k, n)``
    strides, 0 on rows of no expert; ``bounds`` from `_segments`."""
    M, K = a.shape
    S = bounds.shape[0] - 1
    c = torch.empty((M, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    grid = ((cdiv(M, block_m) + S) * cdiv(n, block_n),)
    _grouped_mm_kernel[grid](
        a, b, c, bounds, n, K, S, *a.stride(), *b_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_S=next_pow2(S),
        DOT_FP32=DOT_FP32, PRECISION=dot_precision(a.dtype, fp32_precision),
        num_warps=num_warps, num_stages=num_stages,
    )
    return c


def grouped_linear_fwd(
    x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
    *, block_m: int = 64, block_n: int = 64, block_k: int = 32, num_warps: int = 4, num_stages: int = 3,
    fp32_precision: str = "ieee",
) -> tuple[torch.Tensor]:
    """Returns ``(y [M, N],)``: ``y[rows of e] = x_sorted[rows of e] · weight[e]ᵀ``, no host sync."""
    se, sn, sk = weight.stride()
    bounds = _segments(offsets, x_sorted.shape[0])
    return (_grouped_mm(x_sorted, bounds, weight, (se, sk, sn), weight.shape[1], block_m=block_m,
                        block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                        fp32_precision=fp32_precision),)


def grouped_linear_bwd(
    x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
    y: torch.Tensor, dy: torch.Tensor | None,
    *, block_m: int = 64, block_n: int = 64, block_k: int = 32, num_warps: int = 4, num_stages: int = 3,
    fp32_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(dx_sorted, dweight)``: ``dy · weight[e]`` on each expert's rows, and
    ``dweight[e] = dy[rows of e]ᵀ · x_sorted[rows of e]``; zeros without ``dy``."""
    E, N, K = weight.shape
    if dy is None:
        return (torch.zeros(x_sorted.shape, dtype=x_sorted.dtype, device=x_sorted.device),
                torch.zeros((E, N, K), dtype=weight.dtype, device=weight.device))
    bounds = _segments(offsets, x_sorted.shape[0])
    se, sn, sk = weight.stride()
    dx = _grouped_mm(dy, bounds, weight, (se, sn, sk), K, block_m=block_m, block_n=block_n, block_k=block_k,
                     num_warps=num_warps, num_stages=num_stages, fp32_precision=fp32_precision)
    dweight = torch.empty((E, N, K), dtype=weight.dtype, device=weight.device)
    if dweight.numel():
        _grouped_wgrad_kernel[(E, cdiv(N, block_n) * cdiv(K, block_k))](
            dy, x_sorted, dweight, bounds[1:], N, K, *dy.stride(), *x_sorted.stride(),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_FP32=DOT_FP32, PRECISION=dot_precision(dy.dtype, fp32_precision),
            num_warps=num_warps, num_stages=num_stages,
        )
    return dx, dweight
