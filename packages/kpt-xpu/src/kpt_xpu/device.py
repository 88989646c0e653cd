"""Which Intel GPU is here, if any, and whether the XPU backend can drive it.

Every function reads the machine when called (nothing at import), so that importing the plugin
never initializes the GPU, and works on a torch without ``torch.xpu``. The Triton interpreter is
the base's business (`kpt_triton.backend`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from . import tuning

DEFAULT_INTERPRETER_ARCH = "pvc"

NAMES = (
    (re.compile(r"Data Center GPU Max"), "pvc"),
    (re.compile(r"Data Center GPU Flex"), "acm"),
    (re.compile(r"Arc\(TM\) (Pro )?B\d"), "bmg"),
    (re.compile(r"Arc\(TM\) 1\d0V"), "lnl"),
    (re.compile(r"Arc\(TM\) (Pro )?A\d"), "acm"),
)
"""Arch tag by marketing name, as the driver reports it ("Intel(R) Arc(TM) B580 Graphics")."""

DEVICE_IDS = {0x0BD: "pvc", 0xE20: "bmg", 0xE21: "bmg", 0x642: "lnl", 0x64A: "lnl", 0x64B: "lnl",
              0x569: "acm", 0x56A: "acm", 0x56B: "acm", 0x56C: "acm"}
"""Arch tag by PCI device id without its last hex digit, for names that do not say the part
("Intel(R) Graphics [0x64a0]")."""


def status() -> tuple[bool, str]:
    """``(True, "")`` when an Intel GPU with a tuning table can run the kernels here, else
    ``(False, why not)``."""
    if getattr(torch.version, "xpu", None) is None or not hasattr(torch, "xpu"):
        build = (f"a CUDA {torch.version.cuda} build" if torch.version.cuda else
                 f"a ROCm {torch.version.hip} build" if torch.version.hip else "a CPU build")
        return False, f"torch has no XPU support ({build}): this backend needs an XPU build of torch"
    if not torch.xpu.is_available():
        return False, "no Intel GPU visible"
    from triton.backends import backends
    if "intel" not in backends:
        return False, "Triton has no Intel backend: install the triton of the XPU torch (pytorch-triton-xpu)"
    props = torch.xpu.get_device_properties(torch.xpu.current_device())
    if arch_of(props) is None:
        return False, f"{props.name} has no tuning table: kpt-xpu is built for {', '.join(tuning.ARCHS.values())}"
    return True, ""


def arch_of(props: Any) -> str | None:
    """The arch tag of a device's properties (`torch.xpu.get_device_properties`): by its name,
    else by its PCI device id (where torch reports one); None for another GPU."""
    for pattern, arch in NAMES:
        if pattern.search(props.name):
            return arch
    device_id = getattr(props, "device_id", None)
    return DEVICE_IDS.get(device_id >> 4) if isinstance(device_id, int) else None


def interpreter_arch() -> str:
    """The arch whose tuning the Triton interpreter runs with: ``$KPT_XPU_ARCH``, else pvc."""
    arch = os.environ.get("KPT_XPU_ARCH", DEFAULT_INTERPRETER_ARCH)
    if arch not in tuning.TABLES:
        raise ValueError(f"KPT_XPU_ARCH={arch!r} has no tuning table; expected one of {', '.join(tuning.TABLES)}")
    return arch


def facts() -> dict[str, str]:
    """What benchmark and conformance reports record about the GPU (`status` says it can run)."""
    props = torch.xpu.get_device_properties(torch.xpu.current_device())
    return {
        "device": props.name,
        "arch": str(arch_of(props)),
        "compute_units": str(props.max_compute_units),
        "sub_group_sizes": str(props.sub_group_sizes),
        "driver": str(props.driver_version),
        "xpu": str(torch.version.xpu),
    }
