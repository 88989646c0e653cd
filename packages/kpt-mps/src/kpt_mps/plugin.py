"""The ``kpt.backends`` entry point of kpt-mps."""

from __future__ import annotations

import kpt

from .backend import MpsBackend


@kpt.hookimpl
def kpt_backends() -> list[kpt.Backend]:
    return [MpsBackend()]
