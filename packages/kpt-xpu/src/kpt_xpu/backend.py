"""`XpuBackend`: the portable Triton kernels of kpt-triton, tuned per Intel GPU architecture.

Only wiring on `kpt_triton.backend.TritonBackend`: device detection in `device`, tuning tables
in `tuning`. The products run through torch, i.e. oneDNN on an Intel GPU: ``linear`` (its plain
GEMM; with an activation, kpt-triton's fused GEMM), ``grouped_linear`` (one GEMM per expert,
`moe`) and ``fp8_linear`` (both operands dequantized by a Triton kernel, then one GEMM: none of
these GPUs multiplies float8).
"""

from __future__ import annotations

import torch

import kpt
from kpt_triton.backend import TritonBackend

from . import device, moe, tuning


class XpuBackend(TritonBackend):
    name = "xpu"
    vendor = "Intel"
    device_type = "xpu"
    priority = 100
    tables = tuning.TABLES

    def device_status(self) -> tuple[bool, str]:
        return device.status()

    def detect_arch(self) -> str:
        return device.arch_of(torch.xpu.get_device_properties(torch.xpu.current_device()))

    def interpreter_arch(self) -> str:
        return device.interpreter_arch()

    def kernels(self) -> dict[str, kpt.Kernel]:
        """kpt-triton's bodies, with torch's (oneDNN) ``grouped_linear`` in place of the Triton
        grouped GEMM, under the interpreter too: torch runs it on CPU tensors as well."""
        return {**super().kernels(), **kpt.kernels_from(moe)}

    def device_facts(self) -> dict[str, str]:
        return device.facts()

    def perf_bar(self, kernel: str, mode: str) -> None:
        """No speed is promised: these kernels have not yet run on Intel hardware."""
        return None

