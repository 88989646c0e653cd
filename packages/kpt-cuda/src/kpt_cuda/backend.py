"""`CudaBackend`: the portable Triton kernels of kpt-triton, tuned per NVIDIA architecture.

Only wiring: the kernel bodies come from ``kpt_triton``, and each body gets the tuning of the
GPU it runs on, looked up at its first call. Where CuPy can run it, a vendor-native body in
CUDA C replaces the portable one of the same kernel: only where it measured faster (a CUDA C
top-k gating was dropped: 46 µs against 12 µs for the Triton kernel on an H100).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton

import kpt
from kpt_triton import (
    activations,
    attention,
    cross_entropy,
    fp8,
    layer_norm,
    linear,
    moe,
    rms_norm,
    rope,
    softmax,
)

from . import cross_entropy as native_cross_entropy
from . import device, tuning

KERNEL_MODULES = (
    rms_norm, layer_norm, softmax, activations, rope, attention, linear, cross_entropy, moe, fp8,
)
"""The portable kernel bodies."""

NATIVE_MODULES = (native_cross_entropy,)
"""Vendor-native bodies (CUDA C through CuPy) that replace the portable ones of the same kernel
where CuPy and a GPU are present; elsewhere the Triton bodies run."""


MEMORY_BOUND = ("rms_norm", "add_rms_norm", "layer_norm", "softmax", "gelu", "silu", "swiglu", "geglu", "rope",
                "cross_entropy", "quantize_fp8", "dequantize_fp8")
"""Kernels that move their bytes once: the forward promises a fraction of the copy bandwidth."""

SAME_WORK_AS_EAGER = ("linear", "fp8_linear")
"""Kernels whose eager version calls the same cuBLAS product: they promise the matmul rate."""


class _Tuned:
    """A kernel body called with the tuning keywords of this machine's architecture."""

    def __init__(self, body: Callable[..., Any]) -> None:
        self.body = body
        functools.update_wrapper(self, body)

    @functools.cached_property
    def _params(self) -> dict[str, Any]:
        return tuning.params(device.arch(), self.body.__name__)

    def __call__(self, *args: Any) -> Any:
        return self.body(*args, **self._params)


class CudaBackend(kpt.Backend):
    name = "cuda"
    vendor = "NVIDIA"
    device_type = "cuda"
    priority = 100

    def is_available(self) -> tuple[bool, str]:
        return device.status()

    def kernels(self) -> dict[str, kpt.Kernel]:
        native = () if device.interpreted() else tuple(m for m in NATIVE_MODULES if m.available())
        return {
            name: kpt.Kernel(_Tuned(k.forward), _Tuned(k.backward) if k.backward is not None else None)
            for name, k in kpt.kernels_from(*KERNEL_MODULES, *native).items()
        }

    def perf_bar(self, kernel: str, mode: str) -> kpt.PerfBar:
        """The conformance suite's speed bar (PERF.md shapes, bf16): memory-bound kernels at least
        2x torch eager and, forward, 60% of the copy bandwidth; cuBLAS-backed products 80% of the
        bf16 matmul rate; every other kernel at least as fast as torch eager. The PERF.md targets
        themselves are tracked by the benchmark (`python -m kpt.benchmark`), not by these bars."""
        if kernel in SAME_WORK_AS_EAGER:
            return kpt.PerfBar(min_ceiling_fraction=0.8)
        if kernel in MEMORY_BOUND:
            return kpt.PerfBar(min_speedup=2.0, min_ceiling_fraction=0.6 if mode == "fwd" else None)
        return kpt.PerfBar(min_speedup=1.0)

    @property
    def simulator(self) -> bool:  # type: ignore[override]
        """Under Triton's interpreter the backend is a CPU simulation of itself: usable when
        named, never selected automatically."""
        return device.interpreted()

    def device(self) -> torch.device:
        return torch.device("cpu") if device.interpreted() else torch.device("cuda")

    @property
    def conformance_profile(self) -> str:
        return "cuda-interpret" if device.interpreted() else "cuda"

    def environment(self) -> dict[str, str]:
        return {"torch": torch.__version__, "triton": triton.__version__, **device.facts()}
