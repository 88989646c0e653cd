"""The ``kpt.backends`` entry point of kpt-xpu."""

from __future__ import annotations

import kpt

from .backend import XpuBackend


@kpt.hookimpl
def kpt_backends() -> list[kpt.Backend]:
    return [XpuBackend()]
