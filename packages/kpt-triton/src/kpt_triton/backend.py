"""`TritonBackend`: the base of every vendor backend built on these kernels (kpt-cuda, kpt-rocm, kpt-xpu).

A vendor package fills in only what differs per vendor::

    class RocmBackend(TritonBackend):
        name, vendor, priority = "rocm", "AMD", 100
        tables = tuning.TABLES                   # arch tag -> launcher -> tuning keywords
        def device_status(self): ...             # (True, "") or (False, "no AMD GPU visible")
        def detect_arch(self): ...               # the arch tag of the GPU here ("gfx942")
        def interpreter_arch(self): ...          # the arch whose tuning the interpreter runs
        torch_products = True                    # optional: linear, grouped_linear through torch

and inherits the rest: the kernel list (derived from ``kpt.SPECS``: each kernel's body is
``kpt_triton.<family>.<kernel>_fwd``/``_bwd``, the family being the module of its spec), the
tuning lookup, the interpreter switch (``TRITON_INTERPRET=1`` runs every kernel on CPU tensors
with the tuning of `interpreter_arch`), the speed bars and the report facts.

A tuning table maps a launcher name (``rms_norm_fwd``) to values of its keyword-only tuning
parameters; a launcher or parameter a table leaves out keeps the launcher's portable default,
so a table holds only what its architecture changes.
"""

from __future__ import annotations

import abc
import functools
import importlib
import inspect
import os
import types
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import triton

import kpt

Table = Mapping[str, Mapping[str, Any]]
"""Tuning keywords per launcher name, for one architecture."""

SAME_WORK_AS_EAGER = ("linear", "fp8_linear")
"""Kernels whose eager version calls the same vendor GEMM: they promise the matmul rate."""


def interpreted() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels run in the Triton interpreter on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def portable_modules() -> dict[str, types.ModuleType]:
    """The kpt_triton module of each contract kernel: the one named like its spec's family."""
    return {name: importlib.import_module(f"kpt_triton.{spec.forward.__module__.rsplit('.', 1)[-1]}")
            for name, spec in kpt.SPECS.items()}


def tuning_parameters() -> dict[str, frozenset[str]]:
    """The keyword-only tuning parameters of every portable launcher, by launcher name: what a
    tuning table may set (a table built from this list covers every kernel of ``kpt.SPECS``)."""
    bodies = [f for k in kpt.kernels_from(*dict.fromkeys(portable_modules().values())).values()
              for f in (k.forward, k.backward) if f is not None]
    return {f.__name__: frozenset(n for n, p in inspect.signature(f).parameters.items() if p.kind is p.KEYWORD_ONLY)
            for f in bodies}


class Tuned:
    """A kernel body called with the tuning keywords of an architecture, looked up at its first
    call (importing and binding a backend never touches the device). A table entry serves a vendor's
    native body and the portable one that runs where the native one cannot (kpt-cuda's attention
    without cuDNN, say), which may take fewer keywords: the body gets those it takes."""

    def __init__(self, body: Callable[..., Any], params: Callable[[str], Mapping[str, Any]]) -> None:
        self.body = body
        self._lookup = params
        functools.update_wrapper(self, body)

    @functools.cached_property
    def params(self) -> Mapping[str, Any]:
        params = self._lookup(self.body.__name__)
        taken = inspect.signature(self.body).parameters
        if any(p.kind is p.VAR_KEYWORD for p in taken.values()):
            return params
        return {name: value for name, value in params.items() if name in taken}

    def __call__(self, *args: Any) -> Any:
        return self.body(*args, **self.params)


class TritonBackend(kpt.Backend):
    """The kpt-triton kernels on one vendor's GPUs; see the module docstring for what a vendor
    fills in. ``arch`` pins the tuning table instead of detecting it (the AOT compile check)."""

    device_type = "cuda"  # torch names ROCm devices "cuda" too
    tables: ClassVar[Mapping[str, Table]]
    """Tuning tables by arch tag."""
    spills: ClassVar[Mapping[str, Mapping[str, str]]] = {}
    """Register spills accepted per arch tag: Triton kernel name -> the reason (`kpt_triton.aot`)."""
    torch_products: ClassVar[bool] = False
    """Run the matrix products (``linear``, ``grouped_linear``) through torch, i.e. the vendor's BLAS
    library, instead of kpt-triton's Triton GEMMs: `kpt_triton.products` (under the interpreter too,
    so that its bodies are what CPU tests run)."""

    compiler_fuses: ClassVar[frozenset[str]] = frozenset({"rms_norm", "rope", "swiglu"})
    """Under ``torch.compile``, the row and elementwise kernels of a Llama block go to Inductor,
    which generates Triton for them fused with the residual adds and casts around them; kpt's
    attention and fused loss stay kpt's (`kpt.Backend.compiler_fuses`). Measured on an H200
    training Llama, Qwen3 and Mistral models (benchmarks/models/h200.md): the ops cost about 0.1 ms
    of host time each per call there, which set the pace of a compiled step."""

    def __init__(self, arch: str | None = None) -> None:
        self._arch = arch

    @abc.abstractmethod
    def device_status(self) -> tuple[bool, str]:
        """Whether a GPU of this vendor can run the kernels here, else why not (no interpreter)."""

    @abc.abstractmethod
    def detect_arch(self) -> str:
        """The arch tag (a key of `tables`) of the GPU here; called only when it is available."""

    @abc.abstractmethod
    def interpreter_arch(self) -> str:
        """The arch tag whose tuning the interpreter runs with."""

    def native_modules(self) -> tuple[types.ModuleType, ...]:
        """Vendor-native bodies that replace the portable ones of the same kernels on a device."""
        return ()

    def arch(self) -> str:
        """The arch tag whose tuning table the kernels use."""
        if self._arch is not None:
            return self._arch
        return self.interpreter_arch() if interpreted() else self.detect_arch()

    def params(self, launcher: str) -> Mapping[str, Any]:
        """The tuning keywords of ``launcher`` on this backend's arch."""
        return self.tables[self.arch()].get(launcher, {})

    def is_available(self) -> tuple[bool, str]:
        """The device's status; without a device, the reason says how to run the kernels anyway."""
        if interpreted():
            return True, ""
        available, why = self.device_status()
        return available, why if available else (f"{why} (TRITON_INTERPRET=1 runs its Triton kernels on CPU tensors, "
                                                  f"with numpy: pip install 'kpt-{self.name}[interpret]')")

    def kernels(self) -> dict[str, kpt.Kernel]:
        native = () if interpreted() else self.native_modules()
        modules = dict.fromkeys(portable_modules().values())
        products = (importlib.import_module("kpt_triton.products"),) if self.torch_products else ()
        return {
            name: kpt.Kernel(Tuned(k.forward, self.params),
                             Tuned(k.backward, self.params) if k.backward is not None else None)
            for name, k in kpt.kernels_from(*modules, *products, *native).items()
        }

    def perf_bar(self, kernel: str, mode: str) -> kpt.PerfBar | None:
        """The conformance suite's speed bar (docs/performance.md shapes, bf16): memory-bound kernels at least
        2x torch eager and, forward, 60% of the copy bandwidth; GEMM-backed products 80% of the
        bf16 matmul rate; every other kernel at least as fast as torch eager. The docs/performance.md targets
        themselves are tracked by the benchmark (`python -m kpt.bench`), not by these bars."""
        if kernel in SAME_WORK_AS_EAGER:
            return kpt.PerfBar(min_ceiling_fraction=0.8)
        if kpt.SPECS[kernel].memory_bound:  # moves its bytes once: a fraction of the copy bandwidth
            return kpt.PerfBar(min_speedup=2.0, min_ceiling_fraction=0.6 if mode == "fwd" else None)
        return kpt.PerfBar(min_speedup=1.0)

    def special_values(self, kernel: str, dtype: torch.dtype) -> tuple[str, ...]:
        """All of them, but no bfloat16 subnormals under the interpreter: Triton's interpreter
        (3.6) converts them to float32 wrongly (2.85e-39 is read as 1.10e-38); GPUs convert exactly."""
        left_out = {"subnormal"} if interpreted() and dtype == torch.bfloat16 else set()
        return tuple(s for s in kpt.SPECIAL_VALUES if s not in left_out)

    @property
    def simulator(self) -> bool:  # type: ignore[override]
        """Under Triton's interpreter the backend is a CPU simulation of itself: usable when
        named, never selected automatically."""
        return interpreted()

    def device(self) -> torch.device:
        return torch.device("cpu") if interpreted() else torch.device(self.device_type)

    @property
    def conformance_profile(self) -> str:
        return f"{self.name}-interpret" if interpreted() else self.name

    def device_facts(self) -> dict[str, str]:
        """What reports record about the GPU (called only when it is available)."""
        return {"device": torch.cuda.get_device_name(), "arch": self.arch()}

    def environment(self) -> dict[str, str]:
        versions = {"torch": torch.__version__, "triton": triton.__version__}
        if interpreted():
            return {**versions, "device": "Triton interpreter on CPU tensors (TRITON_INTERPRET=1)",
                    "arch": self.arch()}
        available, why = self.device_status()
        return {**versions, **(self.device_facts() if available else {"device": f"none ({why})"})}
