"""Pointwise activations and gated linear units: ``gelu``, ``silu``, ``swiglu``, ``geglu``.

    gelu(x) = x · Φ(x) = ½ x · (1 + erf(x / √2))                      approximate="none"
            ≈ x · σ(2u),  u = √(2/π) · (x + 0.044715 x³)               approximate="tanh"
    silu(x) = x · σ(x)
    swiglu(gate, up) = silu(gate) · up,   geglu(gate, up) = gelu(gate) · up

``½ (1 + tanh(u)) = σ(2u)`` avoids both a tanh (not portable to every Triton target) and the
cancellation of ``1 + tanh`` for negative u. Derivatives, with φ(x) = exp(−x²/2) / √(2π) and
s = σ(2u)::

    gelu'(x) = Φ(x) + x · φ(x)                                         approximate="none"
             = s + 2 x · s · (1 − s) · √(2/π) · (1 + 3 · 0.044715 x²)    approximate="tanh"
    silu'(x) = σ(x) · (1 + x · (1 − σ(x)))
    gated:   dgate = dy · up · act'(gate),   dup = dy · act(gate)

Everything is computed in float32 and rounded once to the input dtype. One forward and one
backward kernel serve all four kernels (``ACT`` and ``GATED`` are compile-time choices).
Inputs are read as 2-D tiles in their own layout (see `kpt_triton.tiling.as_rows`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import cached_launch
from .tiling import as_rows, dense_like, row_tiling, spread, tile_of, tiles, warps

# These constants multiply tensors from the right only: under the interpreter ``constexpr * tensor``
# is a constexpr that wraps the tensor, which the math functions of Triton 3.9 reject.
_SQRT_HALF = tl.constexpr(math.sqrt(0.5))
_INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_TANH_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """act(x) and act'(x), float32; relu'(0) = 0 and relu'(NaN) = 1 (as torch), relu passes a NaN on."""
    if ACT == "relu":
        return tl.where(x < 0.0, 0.0, x), tl.where(x <= 0.0, 0.0, 1.0)
    elif ACT == "silu":
        s = tl.sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s))
    elif ACT == "gelu_tanh":
        s = tl.sigmoid((x + x * x * x * _TANH_CUBIC) * (2.0 * _SQRT_2_OVER_PI))
        grad = s + 2.0 * x * s * (1.0 - s) * _SQRT_2_OVER_PI * (1.0 + x * x * (3.0 * _TANH_CUBIC))
        return x * s, grad
    else:
        # erfc would keep full relative precision in the far negative tail (x < −4, where
        # |gelu| < 1e-4), but it exists neither on every Triton target nor in the interpreter
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT_HALF))
        return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI


@cached_launch
@triton.jit
def _act_fwd_kernel(
    X, UP, Y,  # UP only with GATED; Y is contiguous [R, D]
    R, D,
    stride_xr, stride_xc, stride_ur, stride_uc,
    ACT: tl.constexpr,  # "gelu", "gelu_tanh" or "silu"
    GATED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows, cols, mask = tile_of(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    x = tl.load(X + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    y, _ = _act(x.to(tl.float32), ACT)
    if GATED:
        up = tl.load(UP + rows[:, None] * stride_ur + cols[None, :] * stride_uc, mask=mask, other=0.0)
        y *= up.to(tl.float32)
    tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _act_bwd_kernel(
    X, UP, DY, DX, DUP,  # UP and DUP only with GATED; DX and DUP are contiguous [R, D]
    R, D,
    stride_xr, stride_xc, stride_ur, stride_uc, stride_dyr, stride_dyc,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows, cols, mask = tile_of(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    x = tl.load(X + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dyr + cols[None, :] * stride_dyc, mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    y, grad = _act(x.to(tl.float32), ACT)
    out = rows[:, None] * D + cols[None, :]
    if GATED:
        up = tl.load(UP + rows[:, None] * stride_ur + cols[None, :] * stride_uc, mask=mask, other=0.0)
        tl.store(DUP + out, (dy * y).to(DUP.dtype.element_ty), mask=mask)
        dy *= up.to(tl.float32)
    tl.store(DX + out, (dy * grad).to(DX.dtype.element_ty), mask=mask)


def _forward(act, x, up, block, elems_per_warp):
    y = dense_like(x)
    if x.numel():
        x2, up2 = as_rows(x, up if up is not None else x)
        r, d = x2.shape
        block, elems_per_warp = spread(x.numel(), block, elems_per_warp, x.device)
        block_r, block_d = row_tiling(d, max_block=block, tile_elems=block)
        _act_fwd_kernel[(tiles(r, d, block_r, block_d),)](
            x2, up2, y, r, d, *x2.stride(), *up2.stride(),
            ACT=act, GATED=up is not None, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=warps(block_r * block_d, elems_per_warp),
        )
    return (y,)


def _backward(act, x, up, dy, block, elems_per_warp):
    dx = dense_like(x)
    dup = dense_like(x) if up is not None else None
    if x.numel():
        x2, up2, dy2 = as_rows(x, up if up is not None else x, dy)
        r, d = x2.shape
        block, elems_per_warp = spread(x.numel(), block, elems_per_warp, x.device)
        block_r, block_d = row_tiling(d, max_block=block, tile_elems=block)
        _act_bwd_kernel[(tiles(r, d, block_r, block_d),)](
            x2, up2, dy2, dx, dup, r, d, *x2.stride(), *up2.stride(), *dy2.stride(),
            ACT=act, GATED=up is not None, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=warps(block_r * block_d, elems_per_warp),
        )
    return (dx,) if up is None else (dx, dup)


def _gelu(approximate: str) -> str:
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def gelu_fwd(x, approximate, *, block: int = 4096, elems_per_warp: int = 512) -> tuple[torch.Tensor]:
    """``(y,)``. Tuning: each program handles ``block`` elements, one warp per ``elems_per_warp``."""
    return _forward(_gelu(approximate), x, None, block, elems_per_warp)


def gelu_bwd(x, approximate, y, dy, *, block: int = 4096, elems_per_warp: int = 512) -> tuple[torch.Tensor]:
    """``(dx,)``."""
    return _backward(_gelu(approximate), x, None, dy, block, elems_per_warp)


def silu_fwd(x, *, block: int = 4096, elems_per_warp: int = 512) -> tuple[torch.Tensor]:
    """``(y,)``; tuning as `gelu_fwd`."""
    return _forward("silu", x, None, block, elems_per_warp)


def silu_bwd(x, y, dy, *, block: int = 4096, elems_per_warp: int = 512) -> tuple[torch.Tensor]:
    """``(dx,)``."""
    return _backward("silu", x, None, dy, block, elems_per_warp)


def swiglu_fwd(gate, up, *, block: int = 4096, elems_per_warp: int = 512) -> tuple[torch.Tensor]:
    """``(y,)``; tuning as `gelu_fwd`."""
    return _forward("silu", gate, up, block, elems_per_warp)


def swiglu_bwd(gate, up, y, dy, *, block: int = 4096,
               elems_per_warp: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)``."""
    return _backward("silu", gate, up, dy, block, elems_per_warp)


def geglu_fwd(gate, up, approximate, *, block: int = 4096, elems_per_warp: int = 512) -> tuple[torch.Tensor]:
    """``(y,)``; tuning as `gelu_fwd`."""
    return _forward(_gelu(approximate), gate, up, block, elems_per_warp)


def geglu_bwd(gate, up, approximate, y, dy, *, block: int = 4096,
              elems_per_warp: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)``."""
    return _backward(_gelu(approximate), gate, up, dy, block, elems_per_warp)
