"""kpt: one kernel API, many accelerators.

    import kpt
    be = kpt.get_backend()          # the best backend installed for this machine
    y = be.rms_norm(x, weight)      # differentiable, torch.compile-able
    print(kpt.list_backends())      # what is installed, and why a backend cannot run here
    kpt.list_kernels()              # the kernels; help(be.rms_norm) documents one

The contract (every kernel's signature, checks, reference math and cost) lives in
``kpt.kernels``; backends plug in through the ``kpt.backends`` entry point (``kpt.hookspecs``).
"""

from __future__ import annotations

from . import nn
from .backend import CONTRACT_VERSION, SPECIAL_VALUES, Backend, PerfBar, describe_missing, kernels_from, missing_kernels
from .errors import BackendError, KernelInputError, KernelNotSupportedError
from .generate import generate
from .hookspecs import hookimpl
from .kernels import SPECS
from .ops import Kernel, torch_autograd
from .overview import info, list_kernels
from .patch import AutoModelForCausalLM, PatchSummary, patch, unpatch
from .registry import (
                       BackendInfo,
                       BackendList,
                       Registry,
                       backend_for,
                       get_backend,
                       list_backends,
                       reload_backends,
                       use_backend,
)
from .spec import FLOAT_DTYPES, BadIndices, BadInput, Case, KernelSpec, checking_indices
from .tolerance import Tolerance, default_tolerance

__version__ = "0.1.0"

__all__ = [
    "CONTRACT_VERSION", "FLOAT_DTYPES", "SPECIAL_VALUES", "SPECS", "AutoModelForCausalLM", "Backend", "BackendError",
    "BackendInfo", "BackendList", "BadInput", "BadIndices", "Case", "Kernel", "KernelInputError",
    "KernelNotSupportedError", "KernelSpec", "PatchSummary", "PerfBar", "Registry", "Tolerance", "backend_for",
    "checking_indices", "default_tolerance", "describe_missing", "generate", "get_backend", "hookimpl", "info",
    "kernels_from", "list_backends", "list_kernels", "missing_kernels", "nn", "patch", "reload_backends",
    "torch_autograd", "unpatch", "use_backend",
]
