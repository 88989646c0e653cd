"""kpt-cuda: the NVIDIA backend of kpt (the portable Triton kernels, tuned per architecture).

Found by kpt through the ``kpt.backends`` entry point (``kpt_cuda.plugin``); use it with
``kpt.get_backend("cuda")``.
"""

from __future__ import annotations

from .backend import CudaBackend

__version__ = "0.1.0"

__all__ = ["CudaBackend"]
