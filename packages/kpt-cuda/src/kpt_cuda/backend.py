"""`CudaBackend`: the portable Triton kernels of kpt-triton, tuned per NVIDIA architecture.

Only wiring on `kpt_triton.backend.TritonBackend`: device detection in `device`, tuning tables
in `tuning`. Where it can run, a vendor-native body (CUDA C through CuPy, or NVIDIA's
libraries through torch) replaces the portable one of the same kernel: only where it measured
faster (a CUDA C top-k gating was dropped: 46 µs against 12 µs for the Triton kernel on an H100).
"""

from __future__ import annotations

import types

import torch

from kpt_triton.backend import TritonBackend

from . import attention, cross_entropy, device, linear, moe, softmax, tuning

NATIVE_MODULES = (attention, cross_entropy, linear, moe, softmax)
"""Vendor-native bodies that replace the portable ones of the same kernel on a GPU where their
`available` says they run (cross-entropy and the softmax forward: CuPy; attention and
grouped_linear: Hopper); elsewhere the Triton bodies run."""


class CudaBackend(TritonBackend):
    name = "cuda"
    vendor = "NVIDIA"
    priority = 100
    tables = tuning.TABLES
    spills = tuning.SPILLS

    def device_status(self) -> tuple[bool, str]:
        return device.status()

    def detect_arch(self) -> str:
        return device.arch()

    def interpreter_arch(self) -> str:
        return "interpret"

    def native_modules(self) -> tuple[types.ModuleType, ...]:
        return tuple(m for m in NATIVE_MODULES if m.available())

    def device_facts(self) -> dict[str, str]:
        return device.facts()

    def special_values(self, kernel: str, dtype: torch.dtype) -> tuple[str, ...]:
        """The base's, but attention on Hopper takes no inf or NaN: there NVIDIA's fused kernels
        (`kpt_cuda.attention`) run it, and their backward does not give the contract's gradients
        for such inputs. On an H100, the valid-call fuzzing with them found NaN in dv where both of
        the contract's values are finite, without a causal mask (one inf in an input: 480 of 1024 dv
        elements; one NaN: dv off by a NaN error norm), `benchmarks/h100-2026-11-26b.md`."""
        values = super().special_values(kernel, dtype)
        if kernel == "attention" and attention in self.native_modules():
            values = tuple(v for v in values if v not in ("inf", "nan"))
        return values
