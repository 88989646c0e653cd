"""Entry point of the ``kpt.backends`` group: the simulator, configured from the environment."""

from __future__ import annotations

import kpt

from .backend import FpgaSimBackend


@kpt.hookimpl
def kpt_backends() -> list[kpt.Backend]:
    return [FpgaSimBackend()]
