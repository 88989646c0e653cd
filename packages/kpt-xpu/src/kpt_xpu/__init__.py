"""kpt-xpu: the Intel GPU backend of kpt (the portable Triton kernels, tuned per architecture).

Found by kpt through the ``kpt.backends`` entry point (``kpt_xpu.plugin``); use it with
``kpt.get_backend("xpu")``. It needs upstream PyTorch's own Intel GPU support (``torch.xpu``
and the Triton that comes with the XPU wheels), never intel-extension-for-pytorch.
"""

from __future__ import annotations

from .backend import XpuBackend

__version__ = "0.1.0"

__all__ = ["XpuBackend"]
