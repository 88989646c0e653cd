"""The hook a backend package implements. Discovery: the ``kpt.backends`` entry-point group.

A backend package declares, in its ``pyproject.toml``::

    [project.entry-points."kpt.backends"]
    cuda = "kpt_cuda.plugin"

and its ``kpt_cuda/plugin.py`` implements the hook::

    import kpt

    @kpt.hookimpl
    def kpt_backends():
        return [CudaBackend()]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .backend import Backend

PROJECT = "kpt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kpt_backends() -> Sequence[Backend]:
    """Return the backends this plugin provides, as `kpt.Backend` instances.

    Called once per plugin when kpt discovers backends. Core calls each plugin's
    implementation on its own: an exception here is recorded against this plugin and
    reported by `kpt.list_backends`, and every other plugin still loads. Constructing a
    backend must be cheap and must not touch the device; device checks belong in
    `Backend.is_available`.
    """
    raise NotImplementedError  # a specification: pluggy calls the plugins' implementations
