"""Linear layer with bias and activation fused in the GEMM epilogue, and the shared dot helper.

    pre = x · weightᵀ + bias          (float32 accumulation)
    y   = act(pre),  act ∈ {relu, gelu (erf), gelu_tanh, silu}

With an activation, one Triton GEMM keeps ``pre`` in float32 registers, adds the bias, and
writes both ``y = act(pre)`` and ``pre`` (rounded to x's dtype, saved for the backward): no pass
over memory besides the GEMM's own. Without one there is nothing to fuse, and the vendor
library's GEMM runs (``torch.addmm``, its bias fused in the library's epilogue).

Backward, with dpre = dy ∘ act'(pre) computed in one Triton pass (relu'(0) = 0):

    dx = dpre · weight,   dweight = dpreᵀ · x,   dbias = Σ_rows dpre     (library GEMMs)

The activations are those of `kpt_triton.activations` (overflow-free for large |pre|).

``dot`` is the matrix product every kernel family here uses: under ``TRITON_INTERPRET=1`` the
interpreter has no 16-bit dot, so ``DOT_FP32`` promotes the operands to float32 there. ``mm`` is the
library GEMM every launcher here calls, in float32 on the interpreter's 16-bit CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kpt.spec import rows

from .activations import _act
from .launch import cached_launch
from .tiling import cdiv, vector

DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"
"""Promote dot operands to float32: set under the Triton interpreter, whose dot has no 16-bit types."""


def dot_precision(dtype: torch.dtype, fp32_precision: str) -> str:
    """The ``PRECISION`` of `dot` for operands of ``dtype``: ``fp32_precision`` ("ieee", "tf32")
    for float32, which is all it affects."""
    return fp32_precision if dtype == torch.float32 else "ieee"


@triton.jit
def dot(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a · b`` (``acc`` may be None); ``PRECISION`` applies to float32 operands."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc, input_precision=PRECISION)


def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
       out: torch.Tensor | None = None) -> torch.Tensor:
    """``a · b`` (``+ bias``) by the library's GEMM (``torch.mm`` / ``torch.addmm``), into ``out`` if
    given. On CPU tensors of 16 bits (Triton's interpreter) the product is taken in float32 and
    rounded once, as a GPU's GEMM accumulates: torch's bfloat16 CPU GEMM lets a NaN of one row of
    ``a`` reach the row beside it (an inf in one row of linear's x made the next row of dx NaN in a
    fuzzed cuda-interpret call; row 1's NaN reaches row 0 at 64 × 5 × 17). Differentiable."""
    if a.is_cpu and a.dtype in (torch.bfloat16, torch.float16):
        wide = torch.mm(a.float(), b.float()) if bias is None else torch.addmm(bias.float(), a.float(), b.float())
        return wide.to(a.dtype) if out is None else out.copy_(wide)
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


@cached_launch
@triton.jit
def _linear_fwd_kernel(
    X, W, BIAS, Y, PRE,  # BIAS only with HAS_BIAS; Y and PRE contiguous [M, N]
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    # GROUP_M row tiles share each column tile in turn, so weight tiles are reused from L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    # 64-bit offsets only for the tile's corner; inside a tile 32 bits suffice and save registers
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    tile_m = tl.arange(0, BLOCK_M)
    tile_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows and columns past the edge repeat the last one: loads stay in bounds, stores drop them
    rows_in = tl.minimum(row0 + tile_m, M - 1) - row0
    cols_in = tl.minimum(col0 + tile_n, N - 1) - col0
    x_ptrs = X + row0.to(tl.int64) * stride_xm + rows_in[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = W + col0.to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk + cols_in[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        acc = dot(a, b, acc, DOT_FP32, PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(BIAS + col0 + cols_in).to(tl.float32)[None, :]
    corner = row0.to(tl.int64) * N + col0
    out = tile_m[:, None] * N + tile_n[None, :]
    mask = (row0 + tile_m[:, None] < M) & (col0 + tile_n[None, :] < N)
    tl.store(PRE + corner + out, acc.to(PRE.dtype.element_ty), mask=mask)
    y, _ = _act(acc, ACTIVATION)
    tl.store(Y + corner + out, y.to(Y.dtype.element_ty), mask=mask)


@cached_launch
@triton.jit
def _activation_bwd_kernel(
    DY, PRE, DPRE,  # PRE and DPRE contiguous [M, N]
    M, N, stride_dym, stride_dyn,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dy = tl.load(DY + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn, mask=mask, other=0.0)
    ptrs = offs_m[:, None] * N + offs_n[None, :]
    pre = tl.load(PRE + ptrs, mask=mask, other=0.0).to(tl.float32)
    _, grad = _act(pre, ACTIVATION)
    dpre = dy.to(tl.float32) * grad
    tl.store(DPRE + ptrs, dpre.to(DPRE.dtype.element_ty), mask=mask)


def linear_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    *, block_m: int = 64, block_n: int = 64, block_k: int = 32, group_m: int = 8,
    num_warps: int = 4, num_stages: int = 3, fp32_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y, pre)``; ``pre`` (x's dtype, y's shape) is empty without an activation.

    The fused GEMM has tiles ``block_m × block_n × block_k``, ``group_m`` row tiles sharing
    each weight tile; ``fp32_precision`` is its dot precision for float32 inputs.
    """
    x2 = rows(x)
    M, K = x2.shape
    N = weight.shape[0]
    shape = (*x.shape[:-1], N)
    if activation is None:
        y = mm(x2, weight.t(), None if bias is None else bias.to(x.dtype))
        return y.reshape(shape), x.new_empty(0)
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    pre = torch.empty(shape, dtype=x.dtype, device=x.device)
    if y.numel():
        _linear_fwd_kernel[(cdiv(M, block_m) * cdiv(N, block_n),)](
            x2, weight, vector(bias), y, pre, M, N, K, *x2.stride(), *weight.stride(),
            HAS_BIAS=bias is not None, ACTIVATION=activation,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
            DOT_FP32=DOT_FP32, PRECISION=dot_precision(x.dtype, fp32_precision),
            num_warps=num_warps, num_stages=num_stages,
        )
    return y, pre


def zero_grads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear's ``(dx, dweight, dbias)`` without an output gradient: zeros (``dbias`` empty without a bias)."""
    return (torch.zeros(x.shape, dtype=x.dtype, device=x.device),
            torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device),
            x.new_empty(0) if bias is None else torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device))


def linear_bwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    y: torch.Tensor, pre: torch.Tensor, dy: torch.Tensor | None,
    *, block: tuple[int, int] = (16, 256),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dx, dweight, dbias)``; ``dbias`` is empty without a bias, all zeros without ``dy``.

    ``block`` is the ``(rows, columns)`` tile of the activation-backward pass.
    """
    N, K = weight.shape
    if dy is None:
        return zero_grads(x, weight, bias)
    x2, dy2 = rows(x), rows(dy)
    M = x2.shape[0]
    dpre = dy2
    if activation is not None:
        dpre = torch.empty((M, N), dtype=x.dtype, device=x.device)
        if dpre.numel():
            _activation_bwd_kernel[(cdiv(M, block[0]), cdiv(N, block[1]))](
                dy2, pre, dpre, M, N, *dy2.stride(),
                ACTIVATION=activation, BLOCK_M=block[0], BLOCK_N=block[1],
            )
    dx = mm(dpre, weight).reshape(x.shape)
    dweight = mm(dpre.t(), x2)
    dbias = x.new_empty(0) if bias is None else dpre.sum(0, dtype=torch.float32).to(bias.dtype)
    return dx, dweight, dbias
