"""The ``kpt.backends`` entry point of kpt-rocm."""

from __future__ import annotations

import kpt

from .backend import RocmBackend


@kpt.hookimpl
def kpt_backends() -> list[kpt.Backend]:
    return [RocmBackend()]
