"""Matrix products through torch (the vendor's BLAS library: hipBLASLt, cuBLASLt, oneDNN) in place of
kpt-triton's Triton GEMMs, for a backend that opts in with `TritonBackend.torch_products`.

    linear:          pre = x · weightᵀ + bias              torch.addmm (bias in the library's epilogue)
                     y   = act(pre)                        one pass of torch's pointwise kernel
    grouped_linear:  y[rows of e] = x[rows of e] · weight[e]ᵀ, 0 on the rows of no expert

``grouped_linear`` reads the offsets as the contract does (`kpt.kernels.moe.expert_bounds`: clamped to
the rows, made non-decreasing), so bad offsets give empty experts and rows outside every expert get
zeros. In bfloat16 with 16-byte aligned rows (K and N multiples of 8) it is one ``torch._grouped_mm``
over the experts' row ranges, with no host synchronization; otherwise (the library's grouped GEMM
takes bfloat16 only) a loop of ``torch.mm`` over the experts, which reads the E + 1 bounds to the host
once per call (not capturable in a CUDA graph).

Backward: linear's is kpt-triton's own (library GEMMs and the Triton activation backward);
grouped_linear's ``dx = dy · weight[e]`` and ``dweight[e] = dy[rows of e]ᵀ · x[rows of e]`` take the
same path as its forward, ``dy`` and ``x`` zeroed on the rows of no expert first (so that a NaN
there reaches no expert's gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kpt.kernels.moe import expert_bounds
from kpt.spec import rows

from .linear import linear_bwd  # noqa: F401  (the body of this module's linear: kernels_from takes both)

ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda pre: F.gelu(pre, approximate="tanh"),
    "silu": F.silu,
}
"""torch's pointwise kernels: as fast as kpt-triton's activation kernel on a large ``pre`` on an
H100, and cheaper to launch on a small one (M = 1: 0.058 against 0.158 ms with gelu_tanh)."""


def linear_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y, pre)`` as `kpt_triton.linear.linear_fwd` does."""
    x2 = rows(x)
    pre = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias.to(x.dtype), x2, weight.t())
    pre = pre.reshape(*x.shape[:-1], weight.shape[0])
    if activation is None:
        return pre, x.new_empty(0)
    return ACTIVATIONS[activation](pre), pre


def _outside_zeroed(t: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows before ``bounds[0]`` and from ``bounds[-1]`` on set to 0."""
    r = torch.arange(t.shape[0], device=t.device)[:, None]
    return torch.where((r >= bounds[0]) & (r < bounds[-1]), t, 0)


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
    one), on the rows of experts only (the others are left to the caller: `_outside_zeroed`)."""
    if _library_grouped(a, *b.shape[1:]):
        return torch._grouped_mm(a.contiguous(), b, offs=bounds[1:].to(torch.int32))
    c = torch.zeros((a.shape[0], b.shape[2]), dtype=a.dtype, device=a.device)
    edges = bounds.tolist()
    for e, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
        if end > start:
            torch.mm(a[start:end], b[e], out=c[start:end])
    return c


def grouped_linear_fwd(x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    """Returns ``(y [M, N],)``."""
    bounds = expert_bounds(offsets, x_sorted.shape[0])
    return (_outside_zeroed(_grouped(x_sorted, weight.contiguous().transpose(1, 2), bounds), bounds),)


def grouped_linear_bwd(
    x_sorted: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, dy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(dx_sorted, dweight)``; zeros without ``dy``."""
    E, N, K = weight.shape
    if dy is None:
        return (torch.zeros(x_sorted.shape, dtype=x_sorted.dtype, device=x_sorted.device),
                torch.zeros((E, N, K), dtype=weight.dtype, device=weight.device))
    bounds = expert_bounds(offsets, x_sorted.shape[0])
    dy = _outside_zeroed(dy, bounds)
    dx = _outside_zeroed(_grouped(dy, weight.contiguous(), bounds), bounds)
    x = _outside_zeroed(x_sorted, bounds)
    if _library_grouped(dy, N, K) and x.shape[0]:
        dweight = torch._grouped_mm(dy.contiguous().t(), x.contiguous(), offs=bounds[1:].to(torch.int32))
    else:
        dweight = torch.zeros((E, N, K), dtype=weight.dtype, device=weight.device)
        edges = bounds.tolist()
        for e, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
            if end > start:
                torch.mm(dy[start:end].t(), x[start:end], out=dweight[e])
    return dx, dweight
