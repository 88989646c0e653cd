"""Vendor-native grouped_linear on Hopper: ``torch._grouped_mm`` (CUTLASS's grouped GEMM in torch)
where it takes the operands, kpt-triton's grouped GEMM elsewhere.

On an H100 kpt-triton's grouped GEMM reached 0.23× of ``torch._grouped_mm`` on MoE shapes
(``benchmarks/``). The library's grouped GEMM takes bfloat16 with rows of 16-byte multiples (K and
N multiples of 8) and reads the expert offsets on the device, so a call stays capturable in a CUDA
graph; every other call (float16, float32, odd sizes) runs the Triton kernel, which reads them on
the device too (`kpt_triton.products`' loop over the experts would synchronize with the host).
"""

from __future__ import annotations

from typing import Any

import torch

from kpt_triton import moe as portable
from kpt_triton import products

from . import device


def available() -> bool:
    """A Hopper GPU (sm90) and a torch with ``torch._grouped_mm``."""
    return device.status()[0] and device.capability()[0] == 9 and hasattr(torch, "_grouped_mm")


def grouped_linear_fwd(x_sorted, offsets, weight, **tuning: Any) -> tuple[torch.Tensor]:
    if products.grouped_in_library(x_sorted, weight):
        return products.grouped_linear_fwd(x_sorted, offsets, weight)
    return portable.grouped_linear_fwd(x_sorted, offsets, weight, **tuning)


def grouped_linear_bwd(x_sorted, offsets, weight, y, dy, **tuning: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if products.grouped_in_library(x_sorted, weight):
        return products.grouped_linear_bwd(x_sorted, offsets, weight, y, dy)
    return portable.grouped_linear_bwd(x_sorted, offsets, weight, y, dy, **tuning)
