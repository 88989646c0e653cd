"""What kpt is compared with: torch eager, torch.compile and the libraries present.

Each peer takes the contract's arguments (checked and in order). `eager_call` is the contract's
reference math run as plain PyTorch; `libraries` names the library functions present for a
kernel (SDPA with each of its backends, cuBLAS then the activation, ``torch._scaled_mm``, a loop
of cuBLAS products and ``torch._grouped_mm``, Liger-Kernel and FlagGems for the kernels
whose spec names them in `kpt.KernelSpec.peers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..backend import Backend
from ..kernels import SPECS
from ..ops import as_tuple
from ..spec import KernelSpec

PEERS = ("eager", "compile", "library")
"""The columns a kernel is compared with; "library" is the fastest library present."""

def eager_call(spec: KernelSpec, backend: Backend) -> Callable[..., Any]:
    """torch eager: the contract's reference math as plain PyTorch ops (no custom op around it)."""

    def call(**kw: Any) -> Any:
        values = spec.forward_values(spec.check((), kw, backend.dtypes), torch.is_grad_enabled())
        return as_tuple(spec.forward(*values))[: len(spec.outputs)]

    return call


_COMPILED: dict[str, Callable[..., Any]] = {}


def compiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)``, made once per process (shapes recompile as torch does for a user)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn)
    return _COMPILED[name]


def forget_compiled(name: str) -> None:
    """Drop the function `compiled` keeps under ``name`` (the next call of `compiled` compiles anew)."""
    _COMPILED.pop(name, None)


def _sdpa(q, k, v, causal, scale):
    """SDPA with the contract's causal alignment (bottom-right: the queries are the last positions
    of the keys); SDPA's ``is_causal`` aligns top-left, the same only when Sq = Skv."""
    import torch.nn.functional as F

    sq, skv = q.shape[-2], k.shape[-2]
    mask = None
    if causal and sq != skv and sq > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(sq, skv)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and sq == skv, scale=scale,
                                          enable_gqa=True)


def _sdpa_backends() -> dict[str, Callable[..., Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def with_backend(b: SDPBackend) -> Callable[..., Any]:
        def call(q, k, v, causal, scale):
            with sdpa_kernel([b]):
                return _sdpa(q, k, v, causal, scale)
        return call

    return {f"SDPA {n}": with_backend(b) for n, b in (
        ("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION))}


def _grouped_loop(x_sorted, offsets, weight):
    """One cuBLAS product per expert over its rows (the offsets read back to the host, as a loop must)."""
    ends = offsets.tolist()
    out = x_sorted.new_zeros(x_sorted.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        if ends[e + 1] > ends[e]:
            out[ends[e]:ends[e + 1]] = x_sorted[ends[e]:ends[e + 1]] @ weight[e].t()
    return out


def _grouped_mm(x_sorted, offsets, weight):
    """``torch._grouped_mm`` (the experts' ends as offsets; rows start at offsets[0] = 0)."""
    return torch._grouped_mm(x_sorted, weight.transpose(-2, -1), offs=offsets[1:])


def libraries(kernel: str) -> tuple[dict[str, Callable[..., Any]], str]:
    """The library functions present for ``kernel`` (by name, taking the contract's arguments) and,
    where the kernel's library is missing, why (e.g. "Liger not installed")."""
    import torch.nn.functional as F

    acts = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}

    def cublas_act(x, weight, bias, activation):
        return acts[activation](F.linear(x, weight, bias))

    def scaled_mm(xq, x_scale, wq, w_scale, bias, out_dtype):
        return torch._scaled_mm(xq, wq.t(), x_scale, w_scale.reshape(1, -1) if w_scale.dim() else w_scale,
                                bias=bias, out_dtype=out_dtype)

    native: dict[str, Callable[[], dict[str, Callable[..., Any]]]] = {
        "attention": _sdpa_backends,
        "linear": lambda: {"cuBLAS+act": cublas_act, "compile(cuBLAS+act)": compiled("linear", cublas_act)},
        "fp8_linear": lambda: {"_scaled_mm": scaled_mm},
        "grouped_linear": lambda: {"cuBLAS loop": _grouped_loop, "_grouped_mm": _grouped_mm},
    }
    if kernel in native:
        return native[kernel](), ""
    found: dict[str, Callable[..., Any]] = {}
    missing = []
    for peer in SPECS[kernel].peers:
        label, adapters = _LIBRARY_PEERS[peer]
        try:
            found[label] = adapters()[kernel]
        except ImportError:
            missing.append(f"{label} not installed")
        except Exception as exc:  # a library that fails to load is left out, with why
            missing.append(f"{label} failed to load ({type(exc).__name__}: {exc})")
    return found, f"n/a: {', '.join(missing)}" if missing and not found else ""


def _liger() -> dict[str, Callable[..., Any]]:
    """Liger-Kernel's functions, taking the contract's arguments."""
    from liger_kernel.transformers import functional as lg

    def rope(q, k, cos, sin):
        return lg.liger_rope(q, k, cos[None] if cos.dim() == 2 else cos, sin[None] if sin.dim() == 2 else sin)

    return {
        "rms_norm": lambda x, weight, eps: lg.liger_rms_norm(x, weight, eps, in_place=False),
        "add_rms_norm": lambda x, residual, weight, eps: lg.liger_fused_add_rms_norm(
            x, residual, weight, eps, in_place=False),
        "layer_norm": lambda x, weight, bias, eps: lg.liger_layer_norm(x, weight, bias, eps),
        "softmax": lambda x, dim: lg.liger_softmax(x),
        "swiglu": lambda gate, up: lg.liger_swiglu(gate, up),
        "geglu": lambda gate, up, approximate: lg.liger_geglu(gate, up),
        "rope": rope,
        "cross_entropy": lambda logits, target, ignore_index, label_smoothing, reduction: lg.liger_cross_entropy(
            logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction),
        "linear_cross_entropy": lambda hidden, weight, target, bias, ignore_index, reduction:
            lg.liger_fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                                reduction=reduction),
    }


def _flag_gems() -> dict[str, Callable[..., Any]]:
    """FlagGems' functions (its aten kernels, with their backward kernels), taking the contract's arguments."""
    import flag_gems

    class Softmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim):
            y = flag_gems.ops.softmax(x, dim)
            ctx.save_for_backward(y)
            ctx.dim, ctx.dtype = dim, x.dtype
            return y

        @staticmethod
        def backward(ctx, dy):
            (y,) = ctx.saved_tensors
            return flag_gems.ops.softmax_backward(dy, y, ctx.dim, ctx.dtype), None

    return {
        "rms_norm": lambda x, weight, eps: flag_gems.ops.rms_norm(x, (x.shape[-1],), weight, eps),
        "softmax": lambda x, dim: Softmax.apply(x, dim),
        "swiglu": lambda gate, up: flag_gems.fused.silu_and_mul(gate, up),
        "cross_entropy": lambda logits, target, ignore_index, label_smoothing, reduction:
            flag_gems.fused.cross_entropy_loss(logits, target, reduction=reduction, ignore_index=ignore_index,
                                               label_smoothing=label_smoothing),
    }


_LIBRARY_PEERS: dict[str, tuple[str, Callable[[], dict[str, Callable[..., Any]]]]] = {
    "liger": ("Liger", _liger), "flag_gems": ("FlagGems", _flag_gems)}
"""The names a `kpt.KernelSpec.peers` entry may take: the label in reports and the adapters."""
