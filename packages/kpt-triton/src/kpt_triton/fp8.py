"""Float8 scaling: ``quantize_fp8``, ``dequantize_fp8`` and the scaled matmul ``fp8_linear``.

    amax  = max |x|                     (over the tensor, or over each row)
    scale = amax / fp8_max   if that is > 0, else 1
    xq    = round_to_nearest_even(clamp(x / scale, −fp8_max, fp8_max))
    dequantize:  y = xq · scale
    fp8_linear:  y = (xq · x_scale) @ (wq · w_scale)ᵀ + bias

Per row, one pass: each program holds whole rows, takes their amax and writes them scaled
(rows wider than one chunk are read twice). Per tensor, two passes: a persistent grid writes
one partial amax per program; the quantizing kernel reduces those few partials in every
program (no host round trip, no atomics) before scaling its tile.

Float8 bits are encoded and decoded with integer arithmetic (`_encode`, `_decode`) rather than
Triton's float8 casts, so the kernels also run where those casts are missing (NVIDIA before
sm89, the interpreter) and round exactly like torch.

``fp8_linear`` runs ``torch._scaled_mm`` (float8 tensor cores, bias in the GEMM epilogue) when
the backend says the device has them (``scaled_mm=True``) and the scales and shapes fit its
rules; otherwise it dequantizes both operands here and runs one ``addmm`` with the bias fused.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kpt.spec import rows

from .launch import cached_launch
from .tiling import (
    as_rows,
    cdiv,
    load_tile,
    nan_max,
    next_pow2,
    persistent_programs,
    row_tiling,
    spread,
    tile_of,
    tiles,
    warps,
)


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr):
    """amax / fp8_max, or 1 where that is 0 (all-zero input, or an amax that underflows); a NaN
    amax gives a NaN scale, as in the reference."""
    scale = amax / FP8_MAX
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _inverse_scale(scale):
    """``(p, 1 / (p · scale))``, p = 2^64 where 1 / scale would overflow float32 (a scale below
    2^-128, from an amax of subnormals), else 1: x / scale is then (x · p) · (1 / (p · scale)),
    the product by p exact."""
    p = tl.where(scale < 1.0e-30, 18446744073709551616.0, 1.0)
    return p, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale * p)


@triton.jit
def _encode(x, inv_scale, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, NATIVE: tl.constexpr):
    """The float8 bits (uint8) of x / scale saturated to ±FP8_MAX, rounded to nearest even.

    ``inv_scale`` is 1 / scale (one correctly rounded division per row or tensor): x · (1 / scale)
    is x / scale but for a float32 rounding, which changes the float8 result only within a
    float32 ulp of a float8 rounding boundary, where it moves it by one float8 step at most.

    ``NATIVE``: convert with the device's float8 instruction (NVIDIA sm89+: one saturating,
    round-to-nearest-even conversion). Otherwise the format (MBITS mantissa bits, smallest
    normal 2^EMIN) is encoded by integer arithmetic: not every Triton target has a float8
    conversion (NVIDIA before sm89 lacks e4m3), and the interpreter's does not carry a rounding
    into the exponent.
    """
    # a NaN stays NaN (a GPU's minimum and maximum would drop it); the enum is written at each call,
    # since a local variable of a compiled kernel must be a tensor
    v = tl.minimum(tl.maximum(x * inv_scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    if NATIVE:
        fp8 = tl.float8e4nv if MBITS == 3 else tl.float8e5
        return v.to(fp8).to(tl.uint8, bitcast=True)
    a = tl.abs(v)
    # the grid step at |v|: 2^(exponent − MBITS), or the subnormal step below 2^EMIN
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    step = ((exponent - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    y = a / step  # exact (a power-of-two divisor), below 2^(MBITS + 1)
    n = y.to(tl.int32)
    frac = y - n.to(tl.float32)
    n += ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    # n counts grid steps: n ≥ 2^MBITS is a normal number (2^(MBITS+1) after rounding up is the
    # next binade: the same bits), below that a subnormal with biased exponent 0
    normal = n >= (1 << MBITS)
    bits = tl.where(normal, ((exponent - EMIN + 1) << MBITS) + n - (1 << MBITS), n)
    bits |= tl.where(v < 0, 0x80, 0)
    return tl.where(v != v, 0x7F, bits).to(tl.uint8)


@triton.jit
def _decode(bits, MBITS: tl.constexpr, EMIN: tl.constexpr, E4M3: tl.constexpr, NATIVE: tl.constexpr):
    """The float32 value of float8 bits (uint8); e4m3fn has no infinity and one NaN pattern.
    ``NATIVE``: convert with the device's instruction, else decode with integer arithmetic."""
    if NATIVE:
        return bits.to(tl.float8e4nv if E4M3 else tl.float8e5, bitcast=True).to(tl.float32)
    b = bits.to(tl.int32)
    biased = (b >> MBITS) & ((1 << (7 - MBITS)) - 1)
    mant = b & ((1 << MBITS) - 1)
    normal = ((biased - 1 + EMIN + 127) << 23) | (mant << (23 - MBITS))
    subnormal_step = tl.full([], (EMIN - MBITS + 127) << 23, tl.int32).to(tl.float32, bitcast=True)
    subnormal = mant.to(tl.float32) * subnormal_step
    mag = tl.where(biased > 0, normal.to(tl.float32, bitcast=True), subnormal)
    if E4M3:
        mag = tl.where((biased == 15) & (mant == 7), float("nan"), mag)
    else:
        mag = tl.where(biased == 31, tl.where(mant == 0, float("inf"), float("nan")), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@cached_launch
@triton.jit
def _quantize_rows_kernel(
    X, XQ, SCALE,  # XQ is contiguous [R, D], SCALE [R]
    R, D,
    stride_xr, stride_xc,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    mask0 = row_ok[:, None] & (cols < D)[None, :]
    x0 = load_tile(X, rows, cols, stride_xr, stride_xc, mask0)
    amax = nan_max(tl.abs(x0), 1)
    for c in range(BLOCK_D, D, BLOCK_D):
        mask = row_ok[:, None] & (c + cols < D)[None, :]
        x = load_tile(X, rows, c + cols, stride_xr, stride_xc, mask)
        amax = tl.maximum(amax, nan_max(tl.abs(x), 1), propagate_nan=tl.PropagateNan.ALL)
    scale = _scale_of(amax, FP8_MAX)
    tl.store(SCALE + rows, scale, mask=row_ok)
    pre, inv_scale = _inverse_scale(scale)
    for c in range(0, D, BLOCK_D):
        mask = row_ok[:, None] & (c + cols < D)[None, :]
        if c == 0:
            x = x0
        else:
            x = load_tile(X, rows, c + cols, stride_xr, stride_xc, mask)
        xq = _encode(x * pre[:, None], inv_scale[:, None], FP8_MAX, MBITS, EMIN, NATIVE)
        tl.store(XQ + rows[:, None] * D + c + cols[None, :], xq, mask=mask)


@cached_launch
@triton.jit
def _amax_kernel(
    X, PARTIAL,  # PARTIAL: one float32 per program
    R, D,
    stride_xr, stride_xc,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    amax = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for t in range(pid, tl.cdiv(R, BLOCK_R) * tl.cdiv(D, BLOCK_D), tl.num_programs(0)):
        rows, cols, mask = tile_of(t, R, D, BLOCK_R, BLOCK_D)
        amax = tl.maximum(amax, tl.abs(load_tile(X, rows, cols, stride_xr, stride_xc, mask)),
                          propagate_nan=tl.PropagateNan.ALL)
    tl.store(PARTIAL + pid, nan_max(nan_max(amax, 1), 0))


@cached_launch
@triton.jit
def _quantize_tensor_kernel(
    X, XQ, PARTIAL, SCALE,  # XQ is contiguous [R, D]; SCALE one float32
    R, D, P,  # P partial maxima
    stride_xr, stride_xc,
    FP8_MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    scale = _scale_of(nan_max(tl.load(PARTIAL + p, mask=p < P, other=0.0), 0), FP8_MAX)
    if pid == 0:
        tl.store(SCALE, scale)
    rows, cols, mask = tile_of(pid, R, D, BLOCK_R, BLOCK_D)
    pre, inv_scale = _inverse_scale(scale)
    xq = _encode(load_tile(X, rows, cols, stride_xr, stride_xc, mask) * pre, inv_scale, FP8_MAX, MBITS, EMIN, NATIVE)
    tl.store(XQ + rows[:, None] * D + cols[None, :], xq, mask=mask)


@cached_launch
@triton.jit
def _dequantize_kernel(
    XQ, SCALE, Y,  # XQ: the float8 bits as uint8; SCALE: one per row (stride_s 0 for one per tensor)
    R, D,  # Y is contiguous [R, D]
    stride_xr, stride_xc, stride_s,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    E4M3: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows, cols, mask = tile_of(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    scale = tl.load(SCALE + rows * stride_s, mask=rows < R, other=0.0)
    bits = tl.load(XQ + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0)
    y = _decode(bits, MBITS, EMIN, E4M3, NATIVE) * scale[:, None]
    tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _fp8_format(dtype: torch.dtype) -> dict[str, int]:
    """The constexprs of a float8 format: mantissa bits and smallest normal exponent."""
    info = torch.finfo(dtype)
    return {"MBITS": -int(math.log2(info.eps)), "EMIN": int(math.log2(info.smallest_normal))}


def quantize_fp8_fwd(x, granularity, fp8_dtype, *, max_block: int = 16384, tile_elems: int = 2048,
                     block: int = 4096, elems_per_warp: int = 512, programs_per_sm: int = 4,
                     native_cast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, scale)``. Tuning: per row as the norms (``max_block``, ``tile_elems``); per tensor
    ``block`` elements per tile and ``programs_per_sm`` programs in the amax pass.
    ``native_cast``: the device converts float32 to float8 in hardware (NVIDIA sm89+)."""
    fmt = {"FP8_MAX": torch.finfo(fp8_dtype).max, "NATIVE": native_cast, **_fp8_format(fp8_dtype)}
    xq = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    if granularity == "row":
        x2 = rows(x)
        n_rows, d = x2.shape
        scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        block_r, block_d = row_tiling(d, max_block=max_block, tile_elems=tile_elems)
        if n_rows:
            _quantize_rows_kernel[(cdiv(n_rows, block_r),)](
                x2, xq.view(torch.uint8), scale, n_rows, d, *x2.stride(), **fmt,
                BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps(block_r * block_d, elems_per_warp),
            )
        return xq, scale
    scale = torch.ones((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return xq, scale
    (x2,) = as_rows(x)
    r, d = x2.shape
    block_r, block_d = row_tiling(d, max_block=block, tile_elems=block)
    n_tiles = tiles(r, d, block_r, block_d)
    programs = persistent_programs(n_tiles, x.device, programs_per_sm)
    partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    num_warps = warps(block_r * block_d, elems_per_warp)
    _amax_kernel[(programs,)](x2, partial, r, d, *x2.stride(), BLOCK_R=block_r, BLOCK_D=block_d,
                              num_warps=num_warps)
    _quantize_tensor_kernel[(n_tiles,)](
        x2, xq.view(torch.uint8), partial, scale, r, d, programs, *x2.stride(), **fmt,
        BLOCK_P=next_pow2(programs), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps,
    )
    return xq, scale


def dequantize_fp8_fwd(xq, scale, dtype, *, block: int = 4096, elems_per_warp: int = 512,
                       native_cast: bool = False) -> tuple[torch.Tensor]:
    """``(y,)``. Tuning: ``block`` elements per tile, one warp per ``elems_per_warp``;
    ``native_cast`` as `quantize_fp8_fwd`."""
    y = torch.empty(xq.shape, dtype=dtype, device=xq.device)
    if xq.numel() == 0:
        return (y,)
    # a per-tensor scale lets a contiguous input be one long row; a per-row one needs the rows
    (x2,) = as_rows(xq) if scale.dim() == 0 else (rows(xq),)
    s = scale.reshape(-1)
    r, d = x2.shape
    block, elems_per_warp = spread(xq.numel(), block, elems_per_warp, xq.device)
    block_r, block_d = row_tiling(d, max_block=block, tile_elems=block)
    _dequantize_kernel[(tiles(r, d, block_r, block_d),)](
        x2.view(torch.uint8), s, y, r, d, *x2.stride(), s.stride(0) if scale.dim() else 0,
        E4M3=xq.dtype == torch.float8_e4m3fn, NATIVE=native_cast, **_fp8_format(xq.dtype),
        BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=warps(block_r * block_d, elems_per_warp),
    )
    return (y,)


def _scaled_mm_operands(xq, x_scale, wq, w_scale, bias, out_dtype):
    """``torch._scaled_mm`` scales (and bias) for this call, or None when its rules exclude it:
    a 16-bit output (float8 tensor cores accumulate with less than float32 precision: 1.3e-4
    relative error measured on an H100, invisible after 16-bit rounding, ten times float32's
    tolerance); K and N multiples of 16, not both operands e5m2; per-tensor scales with a bias in
    the output dtype; or per-row scales (a per-tensor one broadcast) with e4m3 operands, bfloat16
    output."""
    k, n = xq.shape[-1], wq.shape[0]
    if out_dtype == torch.float32 or k % 16 or n % 16 or xq.dtype == wq.dtype == torch.float8_e5m2:
        return None
    if x_scale.dim() == 0 and w_scale.dim() == 0:
        if bias is not None and bias.dtype != out_dtype:
            return None
        return x_scale, w_scale, bias
    e4m3 = xq.dtype == wq.dtype == torch.float8_e4m3fn
    if not e4m3 or out_dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    m = math.prod(xq.shape[:-1])
    # a 2-D xq's row scales are already [M, 1] (each view costs about a microsecond of host time)
    sx = x_scale if x_scale.dim() == 2 else x_scale.reshape(m, 1) if x_scale.dim() else x_scale.expand(m, 1)
    sw = w_scale.reshape(1, n) if w_scale.dim() else w_scale.expand(1, n)
    return sx.contiguous(), sw.contiguous(), bias


def fp8_linear_fwd(xq, x_scale, wq, w_scale, bias, out_dtype, *, scaled_mm: bool = False,
                   block: int = 4096, elems_per_warp: int = 512, native_cast: bool = False) -> tuple[torch.Tensor]:
    """``(y,)``. ``scaled_mm``: the device has float8 tensor cores that ``torch._scaled_mm``
    drives (NVIDIA sm89+); ``block``, ``elems_per_warp`` and ``native_cast`` tune the
    dequantizing fallback."""
    out_shape = (*xq.shape[:-1], wq.shape[0])
    x2 = rows(xq)
    operands = _scaled_mm_operands(xq, x_scale, wq, w_scale, bias, out_dtype) if scaled_mm else None
    if operands is not None:
        sx, sw, b = operands
        y = torch._scaled_mm(x2.contiguous(), wq.contiguous().t(), scale_a=sx, scale_b=sw, bias=b,
                             out_dtype=out_dtype)
        return (y if xq.dim() == 2 else y.reshape(out_shape),)
    sx = x_scale.reshape(-1, 1) if x_scale.dim() else x_scale
    # float32 operands, bias and sum, rounded once to out_dtype: a bias that cancels the product
    # would otherwise show the operands' 16-bit rounding
    dequantize = functools.partial(dequantize_fp8_fwd, block=block, elems_per_warp=elems_per_warp,
                                   native_cast=native_cast)
    (xd,) = dequantize(x2, sx, torch.float32)
    (wd,) = dequantize(wq, w_scale, torch.float32)
    if bias is None:
        y = torch.mm(xd, wd.t())
    else:
        y = torch.addmm(bias.to(torch.float32), xd, wd.t())
    return (y.to(out_dtype).reshape(out_shape),)
