"""Rotary position embedding, rotate-half convention (Llama, GPT-NeoX): ``rope``.

With t = [t₁, t₂] and the tables c = [c₁, c₂], s = [s₁, s₂] split into halves of D::

    out₁ = t₁ · c₁ − t₂ · s₁
    out₂ = t₂ · c₂ + t₁ · s₂

and, since rotate_half is antisymmetric, the backward is the same map with the sine halves
swapped and negated::

    dt₁ = g₁ · c₁ + g₂ · s₂
    dt₂ = g₂ · c₂ − g₁ · s₁

One launch rotates q and k: each program rotates ``BLOCK_S`` positions of one (batch, head) of
q or of k; the tables are indexed per batch (``[B, S, D]``) or shared (``[S, D]``, batch stride
0), and read through the cache by every head.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import cached_launch
from .tiling import cdiv, dense_like, next_pow2, store_output, warps


@triton.jit
def _rope_tile(
    T, COS, SIN, OUT, tile, H, S, HALF,
    stride_tb, stride_th, stride_ts, stride_td, stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, STREAM: tl.constexpr,
):
    """Rotate tile ``tile`` of ``T`` ([B, H, S, D]) into ``OUT`` (contiguous, like T)."""
    s_blocks = tl.cdiv(S, BLOCK_S)
    bh = tile // s_blocks
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    pos = ((tile % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    mask = (pos < S)[:, None] & (d < HALF)[None, :]

    # 64-bit bases per position, 32-bit offsets along the head dimension
    t = (T + b * stride_tb + h * stride_th + pos * stride_ts)[:, None] + (d * stride_td)[None, :]
    t1 = tl.load(t, mask=mask, other=0.0).to(tl.float32)
    t2 = tl.load(t + HALF * stride_td, mask=mask, other=0.0).to(tl.float32)
    c = (COS + b * stride_cb + pos * stride_cs)[:, None] + (d * stride_cd)[None, :]
    c1 = tl.load(c, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF * stride_cd, mask=mask, other=0.0).to(tl.float32)
    s = (SIN + b * stride_sb + pos * stride_ss)[:, None] + (d * stride_sd)[None, :]
    s1 = tl.load(s, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF * stride_sd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1

    out = (OUT + ((b * H + h) * S + pos) * (2 * HALF))[:, None] + d[None, :]
    store_output(out, (t1 * c1 - t2 * s1).to(OUT.dtype.element_ty), mask, STREAM)
    store_output(out + HALF, (t2 * c2 + t1 * s2).to(OUT.dtype.element_ty), mask, STREAM)


@cached_launch
@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, QO, KO,  # QO, KO are contiguous like Q, K
    HQ, HK, S, HALF, Q_TILES,  # heads of q and of k, positions, D / 2, the programs of q
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_cb, stride_cs, stride_cd,  # strides of cos and sin (one shape; batch stride 0 when shared)
    stride_sb, stride_ss, stride_sd,
    BACKWARD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STREAM: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < Q_TILES:
        _rope_tile(Q, COS, SIN, QO, pid, HQ, S, HALF, stride_qb, stride_qh, stride_qs, stride_qd,
                   stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
                   BACKWARD, BLOCK_S, BLOCK_HALF, STREAM)
    else:
        _rope_tile(K, COS, SIN, KO, pid - Q_TILES, HK, S, HALF, stride_kb, stride_kh, stride_ks, stride_kd,
                   stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
                   BACKWARD, BLOCK_S, BLOCK_HALF, STREAM)


@functools.lru_cache(maxsize=4096)
def _tiling(b, s, d, heads_q, heads_k, tile_elems, elems_per_warp, backward, stream):
    """``(programs of q, grid, keywords)`` of a launch over ``heads_q`` and ``heads_k`` heads of ``b``
    sequences of ``s`` positions: computed once per shape and tuning (a decode step's launcher
    spent a microsecond or two of host a call on them). The keywords are shared: never modified."""
    block_half = next_pow2(d // 2)
    block_s = max(1, min(next_pow2(s), tile_elems // (2 * block_half)))
    q_tiles, k_tiles = (b * h * cdiv(s, block_s) for h in (heads_q, heads_k))
    options = {"BACKWARD": backward, "BLOCK_S": block_s, "BLOCK_HALF": block_half, "STREAM": stream,
               "num_warps": warps(2 * block_s * block_half, elems_per_warp)}
    return q_tiles, (q_tiles + k_tiles,), options


def _rotate(q, k, cos, sin, backward, tile_elems, elems_per_warp, stream):
    """Rotate ``q`` and ``k`` (either may be None: nothing to rotate) in one launch."""
    outs = [None if t is None else dense_like(t) for t in (q, k)]
    t0 = q if q is not None else k
    b, _, s, d = t0.shape
    # a shared table is the per-batch table with batch stride 0 (strides given, no expanded view)
    cos_strides, sin_strides = (cos.stride(), sin.stride()) if cos.dim() == 3 else \
        ((0, *cos.stride()), (0, *sin.stride()))
    # an absent tensor runs no program: it stands in for itself with its head count set to 0
    heads = [0 if t is None else t.shape[1] for t in (q, k)]
    ts = [t0 if t is None else t for t in (q, k)]
    os_ = [ts[i] if o is None else o for i, o in enumerate(outs)]
    q_tiles, grid, options = _tiling(b, s, d, *heads, tile_elems, elems_per_warp, backward, stream)
    if grid[0]:
        _rope_kernel.launch(grid, (ts[0], ts[1], cos, sin, os_[0], os_[1], *heads, s, d // 2, q_tiles,
                                   *ts[0].stride(), *ts[1].stride(), *cos_strides, *sin_strides), options)
    return outs


def rope_fwd(q, k, cos, sin, *, tile_elems: int = 4096, elems_per_warp: int = 512,
             stream: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, k_out)``. Tuning: each program rotates about ``tile_elems`` elements (whole
    head rows), one warp per ``elems_per_warp``; ``stream`` marks the outputs as streamed
    (written once, not read again soon: they bypass the caches)."""
    return tuple(_rotate(q, k, cos, sin, False, tile_elems, elems_per_warp, stream))


def rope_bwd(q, k, cos, sin, q_out, k_out, dq_out, dk_out, *, tile_elems: int = 4096,
             elems_per_warp: int = 512, stream: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)``; a missing output gradient gives a zero gradient. ``q``, ``k``: None (not saved)."""
    dq, dk = (None, None) if dq_out is None and dk_out is None else \
        _rotate(dq_out, dk_out, cos, sin, True, tile_elems, elems_per_warp, stream)
    grad_q, grad_k = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) if g is None else g
                      for t, g in ((q_out, dq), (k_out, dk)))
    return grad_q, grad_k
