"""Rotary position embedding, rotate-half convention (Llama, GPT-NeoX): ``rope``.

With t = [t₁, t₂] and the tables c = [c₁, c₂], s = [s₁, s₂] split into halves of D::

    out₁ = t₁ · c₁ − t₂ · s₁
    out₂ = t₂ · c₂ + t₁ · s₂

and, since rotate_half is antisymmetric, the backward is the same map with the sine halves
swapped and negated::

    dt₁ = g₁ · c₁ + g₂ · s₂
    dt₂ = g₂ · c₂ − g₁ · s₁

Each program rotates ``BLOCK_S`` positions of one (batch, head) of q or k; the tables are
indexed per batch (``[B, S, D]``) or shared (``[S, D]``, batch stride 0), and read through
the cache by every head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiling import warps


@triton.jit
def _rope_kernel(
    T, COS, SIN, OUT,  # OUT is contiguous [B, H, S, D]
    H, S, HALF,  # heads, positions, D / 2
    stride_tb, stride_th, stride_ts, stride_td,
    stride_cb, stride_cs, stride_cd,  # strides of cos and sin (one shape; batch stride 0 when shared)
    stride_sb, stride_ss, stride_sd,
    BACKWARD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0)
    s_blocks = tl.cdiv(S, BLOCK_S)
    bh = pid // s_blocks
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    pos = ((pid % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    mask = (pos < S)[:, None] & (d < HALF)[None, :]

    t = T + b * stride_tb + h * stride_th + pos[:, None] * stride_ts + d[None, :] * stride_td
    t1 = tl.load(t, mask=mask, other=0.0).to(tl.float32)
    t2 = tl.load(t + HALF * stride_td, mask=mask, other=0.0).to(tl.float32)
    c = COS + b * stride_cb + pos[:, None] * stride_cs + d[None, :] * stride_cd
    c1 = tl.load(c, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF * stride_cd, mask=mask, other=0.0).to(tl.float32)
    s = SIN + b * stride_sb + pos[:, None] * stride_ss + d[None, :] * stride_sd
    s1 = tl.load(s, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF * stride_sd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1

    out = OUT + ((b * H + h) * S + pos[:, None]) * (2 * HALF) + d[None, :]
    tl.store(out, (t1 * c1 - t2 * s1).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (t2 * c2 + t1 * s2).to(OUT.dtype.element_ty), mask=mask)


def _rotate(t, cos, sin, backward, tile_elems, elems_per_warp):
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    b, h, s, d = t.shape
    if out.numel() == 0:
        return out
    # a shared table is the per-batch table with batch stride 0
    cos3, sin3 = (cos, sin) if cos.dim() == 3 else (cos.expand(b, s, d), sin.expand(b, s, d))
    block_half = triton.next_power_of_2(d // 2)
    block_s = max(1, min(triton.next_power_of_2(s), tile_elems // (2 * block_half)))
    _rope_kernel[(b * h * triton.cdiv(s, block_s),)](
        t, cos3, sin3, out, h, s, d // 2, *t.stride(), *cos3.stride(), *sin3.stride(),
        BACKWARD=backward, BLOCK_S=block_s, BLOCK_HALF=block_half,
        num_warps=warps(2 * block_s * block_half, elems_per_warp),
    )
    return out


def rope_fwd(q, k, cos, sin, *, tile_elems: int = 4096,
             elems_per_warp: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, k_out)``. Tuning: each program rotates about ``tile_elems`` elements (whole
    head rows), one warp per ``elems_per_warp``."""
    return (_rotate(q, cos, sin, False, tile_elems, elems_per_warp),
            _rotate(k, cos, sin, False, tile_elems, elems_per_warp))


def rope_bwd(q, k, cos, sin, q_out, k_out, dq_out, dk_out, *, tile_elems: int = 4096,
             elems_per_warp: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)``; a missing output gradient gives a zero gradient."""
    return tuple(
        _rotate(g, cos, sin, True, tile_elems, elems_per_warp) if g is not None
        else torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        for t, g in ((q, dq_out), (k, dk_out))
    )
