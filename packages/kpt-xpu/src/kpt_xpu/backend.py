"""`XpuBackend`: the portable Triton kernels of kpt-triton, tuned per Intel GPU architecture.

Only wiring on `kpt_triton.backend.TritonBackend`: device detection in `device`, tuning tables
in `tuning`. The products run through torch, i.e. oneDNN on an Intel GPU (`torch_products`:
``linear`` and ``grouped_linear`` from `kpt_triton.products`, under the interpreter too, since torch
runs them on CPU tensors as well), and ``fp8_linear`` dequantizes both operands in a Triton kernel,
then runs one GEMM (none of these GPUs multiplies float8).
"""

from __future__ import annotations

import torch

from kpt_triton.backend import TritonBackend

from . import device, tuning


class XpuBackend(TritonBackend):
    name = "xpu"
    vendor = "Intel"
    device_type = "xpu"
    priority = 100
    tables = tuning.TABLES
    torch_products = True

    def device_status(self) -> tuple[bool, str]:
        return device.status()

    def detect_arch(self) -> str:
        arch = device.arch_of(torch.xpu.get_device_properties(torch.xpu.current_device()))
        assert arch is not None  # device_status refuses a GPU without a tuning table
        return arch

    def interpreter_arch(self) -> str:
        return device.interpreter_arch()

    def device_facts(self) -> dict[str, str]:
        return device.facts()

    def perf_bar(self, kernel: str, mode: str) -> None:
        """No speed is promised: these kernels have not yet run on Intel hardware."""
        return None

