"""Which AMD GPU is here, if any, and whether the ROCm backend can drive it.

Every function reads the machine when called (nothing at import), so that importing the plugin
never initializes the GPU. The Triton interpreter is the base's business (`kpt_triton.backend`).
"""

from __future__ import annotations

import os

import torch

from . import tuning

DEFAULT_INTERPRETER_ARCH = "gfx942"


def status() -> tuple[bool, str]:
    """``(True, "")`` when an AMD GPU with a tuning table can run the kernels here, else
    ``(False, why not)``."""
    if torch.version.hip is None:
        build = f"a CUDA build (CUDA {torch.version.cuda})" if torch.version.cuda else "a CPU build"
        return False, f"torch is {build}: this backend needs a ROCm build of torch"
    if not torch.cuda.is_available():
        return False, "no AMD GPU visible"
    arch = gcn_arch()
    if arch not in tuning.TABLES:
        return False, (f"{torch.cuda.get_device_name()} is {arch}: kpt-rocm is built for "
                       f"{', '.join(tuning.TABLES)}")
    return True, ""


def gcn_arch() -> str:
    """The GPU's architecture without its feature flags ("gfx942" of "gfx942:sramecc+:xnack-")."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]


def interpreter_arch() -> str:
    """The arch whose tuning the Triton interpreter runs with: ``$KPT_ROCM_ARCH``, else gfx942."""
    arch = os.environ.get("KPT_ROCM_ARCH", DEFAULT_INTERPRETER_ARCH)
    if arch not in tuning.TABLES:
        raise ValueError(f"KPT_ROCM_ARCH={arch!r} has no tuning table; expected one of {', '.join(tuning.TABLES)}")
    return arch


def facts() -> dict[str, str]:
    """What benchmark and conformance reports record about the GPU (`status` says it can run)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": torch.cuda.get_device_name(),
        "arch": gcn_arch(),
        "compute_units": str(props.multi_processor_count),
        "hip": str(torch.version.hip),
    }
