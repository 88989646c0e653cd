"""Vendor-native linear: cuBLAS's product, then the activation in its own pass.

The portable body (``kpt_triton.linear``) fuses bias and activation into a Triton GEMM. On an H100
that GEMM reaches about 40% of cuBLAS (8192×14336×4096 bf16 with silu: 3.77 ms against 1.49 ms for
cuBLAS followed by the activation; ``benchmarks/``), so the fused pass over memory it saves is worth
far less than the product it loses. Here cuBLAS computes ``pre = x · weightᵀ + bias`` (its epilogue
adds the bias) and PyTorch's pointwise kernel applies the activation: the same work as the unfused
pair a user would write, with ``pre`` kept for the backward, which is the portable one.

cuBLASLt's GELU and ReLU epilogues (``torch._addmm_activation``) would save the activation pass,
but return only ``act(pre)``, and the backward needs ``pre``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kpt_triton import linear as portable

ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda pre: F.gelu(pre, approximate="tanh"),
    "silu": F.silu,
}


def available() -> bool:
    """Wherever the backend runs on a GPU (cuBLAS comes with every CUDA build of torch)."""
    return True


def linear_fwd(x, weight, bias, activation, **gemm_tuning: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, pre)`` like the portable `kpt_triton.linear.linear_fwd` (``gemm_tuning``, the tiles of
    its Triton GEMM, has nothing to tune here)."""
    pre, empty = portable.linear_fwd(x, weight, bias, None)  # cuBLAS
    if activation is None:
        return pre, empty
    return ACTIVATIONS[activation](pre), pre


linear_bwd = portable.linear_bwd
