"""Which NVIDIA GPU is here, if any, and whether the CUDA backend can drive it.

Every function reads the machine when called (nothing at import), so that importing the
plugin never initializes CUDA. The Triton interpreter (``TRITON_INTERPRET=1``) is the base's
business (`kpt_triton.backend`): these functions describe real hardware only.
"""

from __future__ import annotations

import functools

import torch

MIN_CAPABILITY = (8, 0)
"""The oldest architecture with tuning here (Ampere, sm80)."""


def status() -> tuple[bool, str]:
    """``(True, "")`` when a CUDA GPU can run the kernels here, else ``(False, why not)``."""
    if torch.version.hip is not None:
        return False, f"ROCm build of torch (HIP {torch.version.hip}): this backend drives CUDA devices"
    if torch.version.cuda is None:
        return False, "torch was built without CUDA"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    cc = capability()
    if cc < MIN_CAPABILITY:
        return False, (f"compute capability {cc[0]}.{cc[1]} of {torch.cuda.get_device_name()} is below "
                       f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
    return True, ""


def capability() -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability()
    return major, minor


HBM3E_MIN_BYTES = 120 * 2**30
"""Hopper parts with at least this much memory (H200, GH200 144 GB) have HBM3e, about 40% faster
than the H100's HBM3 with the same multiprocessors: some memory-bound kernels want other tiles."""


def arch() -> str:
    """The tuning table of the GPU here (`status` says it can run): "sm80" (Ampere, Ada), "sm100"
    (data-centre Blackwell, compute capability 10.x: B200, B300; chosen without a GPU, not timed),
    "sm90-hbm3e" (Hopper with HBM3e memory, tuned on an H200) or "sm90" (Hopper and the other
    newer GPUs, tuned on an H100)."""
    cc = capability()
    if cc < (9, 0):
        return "sm80"
    if cc[0] == 10:
        return "sm100"
    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return "sm90-hbm3e" if memory >= HBM3E_MIN_BYTES else "sm90"


def sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@functools.cache
def cupy_version() -> str | None:
    """CuPy's version when it imports and sees a CUDA GPU, so that the vendor-native (CUDA C)
    kernels can run; else None."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        return cupy.__version__ if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except cupy.cuda.runtime.CUDARuntimeError:
        return None


def facts() -> dict[str, str]:
    """What benchmark and conformance reports record about the GPU (`status` says it can run)."""
    major, minor = capability()
    return {
        "device": torch.cuda.get_device_name(),
        "capability": f"{major}.{minor}",
        "arch": arch(),
        "sm_count": str(sm_count()),
        "cuda": str(torch.version.cuda),
        "cupy": cupy_version() or "none (the portable Triton kernels only)",
    }
