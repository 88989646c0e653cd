"""kpt-mps: the Apple-silicon backend of kpt, every kernel a Metal compute shader.

Found by kpt through the ``kpt.backends`` entry point (``kpt_mps.plugin``); use it with
``kpt.get_backend("mps")``. ``KPT_MPS_EMULATE=1`` runs the shaders in the Metal emulator
(`kpt_mps.emulator`) on CPU tensors, on any machine with a C++17 compiler.
"""

from __future__ import annotations

from .backend import MpsBackend

__version__ = "0.1.0"

__all__ = ["MpsBackend"]
