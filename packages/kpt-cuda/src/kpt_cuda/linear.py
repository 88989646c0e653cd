"""Vendor-native linear: cuBLAS's product, then the activation in its own pass (`kpt_triton.products`).

The portable body (``kpt_triton.linear``) fuses bias and activation into a Triton GEMM. On an H100
that GEMM reaches about 40% of cuBLAS (8192×14336×4096 bf16 with silu: 3.77 ms against 1.49 ms for
cuBLAS followed by the activation; ``benchmarks/``), so the pass over memory it saves is worth far
less than the product it loses. cuBLASLt's GELU and ReLU epilogues (``torch._addmm_activation``)
would save that pass, but return only ``act(pre)``, and the backward needs ``pre``.

Only ``linear`` comes from the torch products here; grouped_linear is `kpt_cuda.moe`'s.
"""

from __future__ import annotations

from kpt_triton.products import linear_bwd, linear_fwd

__all__ = ["available", "linear_bwd", "linear_fwd"]


def available() -> bool:
    """Wherever the backend runs on a GPU (cuBLAS comes with every CUDA build of torch)."""
    return True
