"""What kpt offers on this machine: `list_kernels`, `info` (what ``kpt info`` prints), and `provenance`
(what every result file records about the run)."""

from __future__ import annotations

import inspect
import platform
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import torch

from .backend import CONTRACT_VERSION
from .errors import BackendError
from .kernels import SPECS
from .registry import get_backend, list_backends


def list_kernels() -> list[str]:
    """The kernels of the contract, in its order (`kpt.SPECS`). Every backend has one method per
    kernel (``help(backend.rms_norm)`` documents it); `kpt.SPECS` holds their specs."""
    return list(SPECS)


def _call(name: str) -> str:
    """``rms_norm(x, weight=None, eps=1e-06)``: a kernel's parameters and defaults."""
    params = inspect.signature(SPECS[name].signature).parameters.values()
    return f"{name}({', '.join(p.name if p.default is p.empty else f'{p.name}={p.default!r}' for p in params)})"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def provenance(device: torch.device | str) -> dict[str, Any]:
    """What every result file of kpt records beside its numbers: the versions of kpt (with its
    kernel contract), torch, Triton (None where it is not installed) and Python, the device, the
    machine and the time of the run (UTC, ISO 8601)."""
    from . import __version__

    versions = {"kpt": __version__, "contract": CONTRACT_VERSION, "torch": torch.__version__,
                "triton": _version("triton"), "python": platform.python_version()}
    return {"versions": versions, "device": str(device), "machine": platform.machine(),
            "timestamp": datetime.now(UTC).isoformat(timespec="seconds")}


def info(backends: str | None = None) -> str:
    """Versions, the installed backends (`list_backends`, or ``backends`` when given: the same
    table rendered otherwise), the one `get_backend` picks here, and the kernels with their
    parameters."""
    from . import __version__

    try:
        chosen = get_backend().name
    except BackendError as exc:
        chosen = f"none: {exc}"
    return "\n".join([
        f"kpt {__version__} (kernel contract v{CONTRACT_VERSION}), torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        "",
        list_backends().table() if backends is None else backends,
        "",
        f"kpt.get_backend() here: {chosen}",
        "",
        f"kernels ({len(SPECS)}; help(backend.<kernel>) documents one):",
        *(f"  {_call(name)}" for name in list_kernels()),
    ])
