"""kpt-rocm: the AMD backend of kpt (the portable Triton kernels, tuned per architecture).

Found by kpt through the ``kpt.backends`` entry point (``kpt_rocm.plugin``); use it with
``kpt.get_backend("rocm")``.
"""

from __future__ import annotations

from .backend import RocmBackend

__version__ = "0.1.0"

__all__ = ["RocmBackend"]
