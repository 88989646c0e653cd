"""The ``kpt.backends`` entry point of kpt-cuda."""

from __future__ import annotations

import kpt

from .backend import CudaBackend


@kpt.hookimpl
def kpt_backends() -> list[kpt.Backend]:
    return [CudaBackend()]
