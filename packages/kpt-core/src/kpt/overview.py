"""What kpt offers on this machine: `list_kernels`, and `info` (what ``kpt info`` prints)."""

from __future__ import annotations

import inspect
import platform

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


def info() -> str:
    """Versions, the installed backends (`list_backends`), the one `get_backend` picks here, and
    the kernels with their parameters."""
    from . import __version__

    try:
        chosen = get_backend().name
    except BackendError as exc:
        chosen = f"none: {exc}"
    return "\n".join([
        f"kpt {__version__} (kernel contract v{CONTRACT_VERSION}), torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        "",
        list_backends().table(),
        "",
        f"kpt.get_backend() here: {chosen}",
        "",
        f"kernels ({len(SPECS)}; help(backend.<kernel>) documents one):",
        *(f"  {_call(name)}" for name in list_kernels()),
    ])
