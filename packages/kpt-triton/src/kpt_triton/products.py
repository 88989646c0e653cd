"""Matrix products through torch (the vendor's BLAS library: hipBLASLt, cuBLASLt, oneDNN) in place of
kpt-triton's Triton GEMMs, for a backend that opts in with `TritonBackend.torch_products`.

    linear:          pre = x · weightᵀ + bias              torch.addmm (bias in the library's epilogue;
                                                           a float32 bias beside 16-bit x: a float32
                                                           product, then the bias in float32)
                     y   = act(pre)                        one pass of torch's pointwise kernel
    grouped_linear:  y[rows of e] = x[rows of e] · weight[e]ᵀ, 0 on the rows of no expert

``grouped_linear`` reads the offsets as the contract does (`kpt.kernels.moe.expert_bounds`: clamped to
the rows, made non-decreasing), so bad offsets give empty experts and rows outside every expert get
zeros. In bfloat16 with 16-byte aligned rows (K and N multiples of 8) it is one ``torch._grouped_mm``
over the experts' row ranges, with no host synchronization; otherwise (the library's grouped GEMM
takes bfloat16 only) a loop of ``torch.mm`` over the experts, which reads the E + 1 bounds to the host
once per call (not capturable in a CUDA graph).

Backward: linear's ``dpre = dy ⊙ act'(pre)`` is torch's pointwise backward (one launch; relu's is a
product with ``pre > 0``, so a NaN in ``dy`` stays NaN as in the reference), then library GEMMs.
grouped_linear's ``dx = dy · weight[e]`` and ``dweight[e] = dy[rows of e]ᵀ · x[rows of e]`` take the
same path as its forward. The library's grouped GEMM counts rows from 0 and leaves those past the last
expert unwritten: the rows before the first expert and past the last are set to 0 afterwards by a
Triton pass that writes only them (`_zero_outside_kernel`: nothing to write in the usual case), and
the weight gradient groups the rows before the first expert as an extra group it drops, so a NaN
there reaches no expert's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kpt.kernels.moe import expert_bounds
from kpt.ops import torch_autograd
from kpt.spec import rows

from .launch import cached_launch
from .linear import mm, zero_grads
from .tiling import cdiv


def _gelu(pre: torch.Tensor) -> torch.Tensor:
    """``F.gelu``; torch's CPU kernel gives NaN for +inf (its GPU kernels, and the contract, +inf)."""
    y = F.gelu(pre)
    return torch.where(pre == float("inf"), pre, y) if pre.device.type == "cpu" else y


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": _gelu,
    "gelu_tanh": lambda pre: F.gelu(pre, approximate="tanh"),
    "silu": F.silu,
}
"""torch's pointwise kernels: as fast as kpt-triton's activation kernel on a large ``pre`` on an
H100, and cheaper to launch on a small one (M = 1: 0.058 against 0.158 ms with gelu_tanh)."""


class _Float32Product(torch.autograd.Function):
    """``x2 · weightᵀ`` of 16-bit operands written in float32 by the library's GEMM
    (``torch.mm(..., out_dtype=torch.float32)``, CUDA and ROCm builds; torch has no derivative for
    it): the backward's products in the operands' dtype, as `linear_bwd`'s."""

    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        return torch.mm(x2, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x2, weight = ctx.saved_tensors
        grad = grad.to(x2.dtype)
        return (torch.mm(grad, weight) if ctx.needs_input_grad[0] else None,
                torch.mm(grad.t(), x2) if ctx.needs_input_grad[1] else None)


def _product_in_float32(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 · weightᵀ`` with a float32 result: the library's GEMM writing float32 where torch has
    one (`_Float32Product`), else float32 copies (the CPU, where only the interpreter profiles run)."""
    if x2.is_cuda:
        return _Float32Product.apply(x2, weight)
    return torch.mm(x2.float(), weight.float().t())


ACTIVATION_GRADS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "relu": lambda dy, pre: dy * ~(pre <= 0),  # relu'(NaN) = 1, as torch.relu's own backward
    "gelu": lambda dy, pre: torch.ops.aten.gelu_backward(dy, pre),
    "gelu_tanh": lambda dy, pre: torch.ops.aten.gelu_backward(dy, pre, approximate="tanh"),
    "silu": torch.ops.aten.silu_backward,
}
"""``dy ⊙ act'(pre)`` by torch's pointwise kernels (float32 math for 16-bit tensors)."""


@torch_autograd
def linear_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y, pre)`` as `kpt_triton.linear.linear_fwd` does. Torch operations only: an eager
    call that needs gradients is differentiated by torch's autograd (`kpt.torch_autograd`), the
    per-call host cost of ``F.linear`` and the activation; `linear_bwd` serves compiled calls."""
    if bias is not None and bias.dtype != x.dtype:
        # a float32 bias beside 16-bit activations: added in float32 to a float32 product, the
        # activation on that, as the contract does (``torch.addmm`` would round the bias to the
        # activations' dtype first: -max became -inf, gelu(-inf) NaN; a pre-activation near 0
        # changed sign, and relu' with it)
        shape = (*x.shape[:-1], weight.shape[0])
        pre32 = _product_in_float32(rows(x), weight) + bias
        pre = pre32.to(x.dtype).reshape(shape)
        if activation is None:
            return pre, x.new_empty(0)
        return ACTIVATIONS[activation](pre32).to(x.dtype).reshape(shape), pre
    # addmm adds the bias before its one rounding (F.linear of a 3-D input rounds the product first:
    # relu's gradient then flipped where the pre-activation was near 0); no reshape for a 2-D input
    x2 = rows(x)
    pre = mm(x2, weight.t(), bias)
    if x.dim() != 2:
        pre = pre.reshape(*x.shape[:-1], weight.shape[0])
    if activation is None:
        return pre, x.new_empty(0)
    return ACTIVATIONS[activation](pre), pre


def linear_bwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
    y: torch.Tensor, pre: torch.Tensor, dy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dx, dweight, dbias)`` as `kpt_triton.linear.linear_bwd` does."""
    if dy is None:
        return zero_grads(x, weight, bias)
    x2, dpre = rows(x), rows(dy)
    if activation is not None:
        dpre = ACTIVATION_GRADS[activation](dpre, rows(pre))
    dx = mm(dpre, weight).reshape(x.shape)
    dweight = mm(dpre.t(), x2)
    dbias = x.new_empty(0) if bias is None else dpre.sum(0, dtype=torch.float32).to(bias.dtype)
    return dx, dweight, dbias


@cached_launch
@triton.jit
def _zero_outside_kernel(t_ptr, bounds_ptr, M, N, E, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    lo = tl.load(bounds_ptr)
    hi = tl.load(bounds_ptr + E)
    first = tl.program_id(0) * BLOCK_M
    if (first < lo) | (first + BLOCK_M > hi):
        r = first + tl.arange(0, BLOCK_M)
        c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        outside = ((r < lo) | (r >= hi)) & (r < M)
        ptrs = t_ptr + r[:, None].to(tl.int64) * stride + c[None, :]
        tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=t_ptr.dtype.element_ty),
                 mask=outside[:, None] & (c[None, :] < N))


def _zero_outside(t: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``t`` (a dense [M, N] result of the library) with the rows before ``bounds[0]`` and from
    ``bounds[-1]`` on set to 0, in place; blocks of rows inside the experts are not touched."""
    if t.numel():
        block_m, block_n = 64, 128
        _zero_outside_kernel[(cdiv(t.shape[0], block_m), cdiv(t.shape[1], block_n))](
            t, bounds, t.shape[0], t.shape[1], bounds.shape[0] - 1, t.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    return t


def _library_grouped(a: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` takes operands like ``a`` with these sizes of their rows and
    the output's: bfloat16, every size a positive multiple of 8 (rows of 16-byte multiples)."""
    return a.dtype == torch.bfloat16 and all(d > 0 and d % 8 == 0 for d in dims)


def grouped_in_library(x_sorted: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `grouped_linear_fwd` and `grouped_linear_bwd` run these operands as single
    ``torch._grouped_mm`` calls (no host synchronization), not as a loop over the experts."""
    return _library_grouped(x_sorted, *weight.shape[1:])


def _grouped(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``c[rows of e] = a[rows of e] · b[e]`` for ``b`` [E, K, N] (a dense tensor or the transpose of
    one), 0 on the rows of no expert."""
    if _library_grouped(a, *b.shape[1:]):
        return _zero_outside(torch._grouped_mm(a.contiguous(), b, offs=bounds[1:].to(torch.int32)), bounds)
    c = torch.zeros((a.shape[0], b.shape[2]), dtype=a.dtype, device=a.device)
    edges = bounds.tolist()
    for e, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
        if end > start:
            mm(a[start:end], b[e], out=c[start:end])
    return c


def grouped_linear_fwd(x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    """Returns ``(y [M, N],)``."""
    bounds = expert_bounds(offsets, x_sorted.shape[0])
    return (_grouped(x_sorted, weight.contiguous().transpose(1, 2), bounds),)


def grouped_linear_bwd(
    x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, dy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(dx_sorted, dweight)``; zeros without ``dy``."""
    E, N, K = weight.shape
    if dy is None:
        return (torch.zeros(x_sorted.shape, dtype=x_sorted.dtype, device=x_sorted.device),
                torch.zeros((E, N, K), dtype=weight.dtype, device=weight.device))
    bounds = expert_bounds(offsets, x_sorted.shape[0])
    dx = _grouped(dy, weight.contiguous(), bounds)
    if _library_grouped(dy, N, K) and x_sorted.shape[0]:
        # group 0 is the rows before the first expert: computed, then dropped
        groups = torch._grouped_mm(dy.contiguous().t(), x_sorted.contiguous(), offs=bounds.to(torch.int32))
        dweight = groups[1:]
    else:
        dweight = torch.zeros((E, N, K), dtype=weight.dtype, device=weight.device)
        edges = bounds.tolist()
        for e, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
            if end > start:
                mm(dy[start:end].t(), x_sorted[start:end], out=dweight[e])
    return dx, dweight
