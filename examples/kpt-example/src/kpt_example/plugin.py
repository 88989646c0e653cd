"""The entry point (``kpt.backends``): it only wires the backend in."""

from __future__ import annotations

import kpt

from .backend import ExampleBackend


@kpt.hookimpl
def kpt_backends() -> list[kpt.Backend]:
    return [ExampleBackend()]
