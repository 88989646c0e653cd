"""Whether an Apple GPU can run kpt-mps's shaders here, and the facts reports record about it.

Every function reads the machine when called (nothing at import). The emulator
(``KPT_MPS_EMULATE=1``) is the backend's business: these describe real hardware only.
"""

from __future__ import annotations

import platform
import sys

import torch

MIN_TORCH = (2, 6)
"""``torch.mps.compile_shader`` appeared in PyTorch 2.6."""

BF16_MACOS = (14, 0)
"""MPS has bfloat16 tensors from macOS 14 (Sonoma) on."""


def macos_version() -> tuple[int, ...]:
    """The macOS version, ``()`` elsewhere."""
    release = platform.mac_ver()[0] if sys.platform == "darwin" else ""
    return tuple(int(p) for p in release.split(".") if p.isdigit())


def status() -> tuple[bool, str]:
    """``(True, "")`` when the shaders can run on an Apple GPU here, else ``(False, why not)``."""
    if sys.platform != "darwin":
        return False, "not macOS"
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
        return False, f"torch {torch.__version__} older than 2.6 (no torch.mps.compile_shader)"
    if not torch.backends.mps.is_built():
        return False, "MPS not built into this torch"
    if not torch.backends.mps.is_available():
        return False, "MPS not available (no Apple GPU visible)"
    if not hasattr(torch.mps, "compile_shader"):
        return False, "torch.mps.compile_shader missing from this torch"
    return True, ""


def bf16_supported() -> bool:
    return macos_version() >= BF16_MACOS


def facts() -> dict[str, str]:
    return {"device": f"Apple GPU (MPS), macOS {'.'.join(map(str, macos_version()))}", "machine": platform.machine()}
