"""`MpsBackend`: kpt's kernels as Metal compute shaders on Apple GPUs.

Only wiring: the bodies are the family modules (``rms_norm.py``... each launching the kernels of
its ``shaders/<family>.metal``), device detection is `kpt_mps.device`, launching `kpt_mps.metal`.
With ``KPT_MPS_EMULATE=1`` every kernel runs in the Metal emulator on CPU tensors: the backend is
then a simulator (usable when named, never picked automatically) with the conformance profile
``mps-emulate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import kpt

from . import device, metal
from .families import FAMILIES


class MpsBackend(kpt.Backend):
    name = "mps"
    vendor = "Apple"
    device_type = "mps"
    priority = 90

    def is_available(self) -> tuple[bool, str]:
        if metal.emulated():
            return True, ""
        available, why = device.status()
        hint = "KPT_MPS_EMULATE=1 runs the shaders in the Metal emulator on CPU tensors"
        return available, why if available else f"{why} ({hint})"

    def kernels(self) -> dict[str, kpt.Kernel]:
        return kpt.kernels_from(*FAMILIES)

    def unsupported(self, kernel: str, args: Mapping[str, Any]) -> str | None:
        bf16 = any(v is torch.bfloat16 or (isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16)
                   for v in args.values())
        if bf16 and not metal.emulated() and not device.bf16_supported():
            return "bfloat16 on MPS needs macOS 14 or newer"
        return None

    @property
    def simulator(self) -> bool:  # type: ignore[override]
        return metal.emulated()

    def device(self) -> torch.device:
        return torch.device("cpu") if metal.emulated() else torch.device("mps")

    @property
    def conformance_profile(self) -> str:
        return "mps-emulate" if metal.emulated() else "mps"

    def environment(self) -> dict[str, str]:
        versions = {"torch": torch.__version__}
        if metal.emulated():
            from .emulator import compiler

            return {**versions, "device": f"Metal emulator on CPU tensors (KPT_MPS_EMULATE=1), compiler {compiler()}"}
        available, why = device.status()
        return {**versions, **(device.facts() if available else {"device": f"none ({why})"})}
