"""`Backend`: the base class every backend subclasses, and the calls users make on it.

A backend declares who it is (``name``, ``vendor``, ``device_type``, ``priority``), says whether
it can run here (`Backend.is_available`) and supplies kernel bodies (`Backend.kernels`). Core
gives every backend the same public methods, one per kernel of the contract
(``backend.rms_norm(x, weight)``..., generated into `kpt.methods`): each validates its inputs
with the kernel's spec, then runs the backend's body: under ``torch.compile`` as the backend's
custom op (see `kpt.ops`), in eager mode directly, through a ``torch.autograd.Function`` when a
gradient is needed.
"""

from __future__ import annotations

import abc
import difflib
import functools
import inspect
import re
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from .errors import BackendError, KernelInputError, KernelNotSupportedError
from .kernels import SPECS
from .methods import KernelMethods
from .ops import Kernel, as_tuple, eager_functions, register_all
from .spec import FLOAT_DTYPES, KernelSpec, indices_checked
from .tolerance import Tolerance

NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
"""What a backend name may be: lower-case words of letters and digits joined by single hyphens.
One spelling per name, so that names map one-to-one to op namespaces (``acme-npu`` is
``kpt_acme_npu``; ``acme_npu`` is not a name)."""

CONTRACT_VERSION = 2
"""The version of the kernel contract (docs/contract.md; its changes in CHANGELOG.md) that this
kpt-core implements; backends declare the one they target."""

SPECIAL_VALUES: tuple[str, ...] = ("zero", "subnormal", "max", "inf", "nan")
"""The kinds of special values of a floating-point input: ±0, subnormals, ±max of the dtype, ±inf, NaN."""


@dataclass(frozen=True)
class PerfBar:
    """A backend's speed promise for one kernel, checked by the conformance performance tests.

    ``min_speedup``: at least this many times faster than torch eager on the same device (a
    simulator's bar is below 1: at most 1/x times slower than the reference backend);
    ``min_ceiling_fraction``: at least this fraction of the bounding ceiling (copy bandwidth or
    matmul rate) measured in the same run. ``None`` means not promised. ``cases``: "perf" times
    the docs/performance.md shape on the device, against these bars; "conformance" (simulators) times the
    conformance shapes on the CPU against the reference backend and reports it without gating:
    CPU timing swings too much between runs to hold a bar.
    """

    min_speedup: float | None = None
    min_ceiling_fraction: float | None = None
    cases: str = "perf"


class Backend(KernelMethods):
    """Base class of every backend. Subclasses set the class attributes and implement `kernels`;
    the kernel methods (``backend.rms_norm``...) come from `kpt.methods.KernelMethods`."""

    name: ClassVar[str]
    """Matches `NAME`; a plugin's backends are named after its entry point (`kpt.registry`)."""
    vendor: ClassVar[str]
    device_type: ClassVar[str]
    """The torch device type its tensors live on ("cpu", "cuda", "xpu", "mps")."""
    priority: ClassVar[int] = 0
    """Higher wins when no backend is named; the reference backend has priority 0."""
    simulator: ClassVar[bool] = False
    """Simulators (fpga-sim) are never selected automatically."""
    contract_version: ClassVar[int] = CONTRACT_VERSION
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES
    compiler_fuses: ClassVar[frozenset[str]] = frozenset()
    """Kernels that a call traced by ``torch.compile`` gives to the compiler as the contract's own
    torch expression (the reference body, differentiated by autograd) instead of this backend's
    op, for Inductor to fuse with the ops around it: where the backend's kernel is itself what
    Inductor would generate (a Triton row or elementwise kernel), the op only costs a launch from
    Python and a round trip through memory. Eager calls run the backend's kernel as always."""
    checks_indices: ClassVar[bool] = False
    """Check index values (targets, expert ids, offsets, permutations) on every call, not only in
    checked mode (`kpt.checking_indices`): for backends where reading them costs nothing (CPU)."""

    def is_available(self) -> tuple[bool, str]:
        """``(True, "")`` when it can run on this machine, else ``(False, why not)``."""
        return True, ""

    @abc.abstractmethod
    def kernels(self) -> Mapping[str, Kernel]:
        """The kernel bodies, by kernel name (see `kernels_from`)."""

    def device(self) -> torch.device:
        """The device the conformance suite puts this backend's inputs on."""
        return torch.device(self.device_type)

    def unsupported(self, kernel: str, args: Mapping[str, Any]) -> str | None:
        """Why this valid call is not supported here (raised as KernelNotSupportedError), or None."""
        return None

    def special_values(self, kernel: str, dtype: torch.dtype) -> tuple[str, ...]:
        """The kinds of `SPECIAL_VALUES` that ``kernel`` takes in ``dtype`` as the contract says
        (`kpt.kernels`, "Special values"): the conformance suite fuzzes it with those. A format
        without them (a fixed-point design) takes none; a documented limitation leaves one out."""
        return SPECIAL_VALUES

    def fuzzed_gradients(self, kernel: str) -> bool:
        """Whether the conformance suite's fuzzing checks the gradients of fuzzed calls of ``kernel``
        (their forward results are always checked). A backend whose gradient tolerances hold for
        the contract's own cases only says False, and why, in its override."""
        return True

    def beyond_format(self, kernel: str, args: Mapping[str, Any]) -> str | None:
        """Why a valid call of ``kernel`` with ``args`` lies beyond what this backend's number format
        resolves (its conformance cases of that kind are declared expected failures), else None:
        the conformance suite's fuzzing draws no such call. Every call by default; a fixed-point
        design names the data its format cannot hold or resolve."""
        return None

    def tolerance(self, kernel: str, dtype: torch.dtype) -> Tolerance | None:
        """A tolerance other than the default table's, with its reason; None keeps the default."""
        return None

    def call_tolerance(self, kernel: str, dtype: torch.dtype, args: Mapping[str, Any],
                       output: str) -> Tolerance | None:
        """`tolerance` for one call's ``output`` (a forward output's name, or ``d`` and an input's
        name for a gradient), given the call's arguments (for a gradient also the upstream
        gradients, each named ``d`` and its output's name): for bounds that depend on shapes or
        magnitudes (a fixed-point error that grows with a contraction's length, or is absolute at
        the scale of the data). The default ignores the call."""
        return self.tolerance(kernel, dtype)

    def perf_bar(self, kernel: str, mode: str) -> PerfBar | None:
        """What speed this backend promises for ``kernel`` in ``mode`` ("fwd" or "fwd+bwd");
        None promises nothing."""
        return None

    def environment(self) -> dict[str, str]:
        """Versions and device facts recorded with conformance reports and benchmarks."""
        return {"torch": torch.__version__}

    @property
    def conformance_profile(self) -> str:
        """Names the xfail file of this configuration (``conformance/xfails/<profile>.txt``)."""
        return self.name

    @property
    def op_namespace(self) -> str:
        """The torch.library namespace of this backend's ops: ``kpt_`` and the name, hyphens as
        underscores (one-to-one, as `NAME` has no underscores)."""
        return "kpt_" + self.name.replace("-", "_")

    def __repr__(self) -> str:
        return f"<kpt backend {self.name!r} ({self.vendor}, {self.device_type})>"

    # -- calls -----------------------------------------------------------------------------

    def register_ops(self) -> dict[str, Any]:
        """Register this backend's custom ops with ``torch.library`` (once) and return them by
        kernel name; `kpt.get_backend` does it before returning, so that a call inside
        ``torch.compile`` only traces the op. A backend that lacks kernels is refused here
        (`BackendError`)."""
        registration = self._registration
        if registration.missing:
            raise BackendError(f"backend {self.name!r} is missing kernels: {describe_missing(registration.missing)}")
        return registration.ops

    def bodies(self, kernel: str) -> Kernel:
        """``kernel``'s bodies on this backend, to call without the contract's check and dispatch:
        for kpt's own composite ops (`kpt.nn`), on tensors that a checked call of the same kernel
        already took (a backward computing the forward's product again)."""
        return self._registration.kernels[kernel]

    @functools.cached_property
    def _registration(self) -> _Registration:
        # an incomplete backend still runs the kernels it has (the conformance suite checks a
        # backend kernel by kernel); each missing body raises BackendError when called
        check_name(self.name)
        given = self.kernels()
        missing = missing_kernels(given)
        kernels = _guarded(self.name, _with_missing_bodies(self.name, given, missing))
        return _Registration(kernels, register_all(self.op_namespace, kernels), eager_functions(kernels), missing)

    def call(self, kernel: str, *args: Any, **kwargs: Any) -> Any:
        """Validate a call of ``kernel`` against its spec and run it on this backend."""
        try:
            spec = SPECS[kernel]
        except KeyError:
            raise KernelInputError(unknown_kernel(kernel)) from None
        bound = spec.check(args, kwargs, self.dtypes)
        reason = self.unsupported(kernel, bound)
        if reason:
            raise KernelNotSupportedError(f"{kernel}: not supported by backend {self.name!r}: {reason}")
        grad_enabled = torch.is_grad_enabled()
        meta = requires_grad = False  # of any tensor: one pass over them (a call's host time counts)
        for v in bound.values():
            if isinstance(v, torch.Tensor):
                meta |= v.is_meta
                requires_grad |= v.requires_grad
        needs_grad = grad_enabled and requires_grad and _needs_grad(spec, bound)
        values = spec.forward_values(bound, spec.needs_grad_arg and needs_grad)
        registration = self._registration
        compiling = torch.compiler.is_compiling()
        traced = meta or compiling
        if not traced and (dtensors := _distributed(self, values)) is not None:
            values, traced = dtensors, True
        if spec.check_indices is not None and not traced and indices_checked(self.checks_indices):
            spec.check_indices(bound)
        how = (compiling and kernel in self.compiler_fuses, traced, needs_grad, grad_enabled and requires_grad)
        if torch._C._is_any_autocast_enabled():
            # a kernel computes as the contract says for the dtypes it is given: autocast's casts
            # (mixed precision) would reach the torch operations of a body, of the compiler's
            # expression or of an op's fake implementation (a 16-bit product where the contract
            # takes float32), so they stop at the call
            device = next(v.device.type for v in values if isinstance(v, torch.Tensor))
            with torch.autocast(device, enabled=False):
                out = _run(registration, spec, values, *how)
        else:
            out = _run(registration, spec, values, *how)
        out = as_tuple(out)[: len(spec.outputs)]
        return out[0] if len(out) == 1 else out


def _run(registration: _Registration, spec: KernelSpec, values: list[Any], fused: bool, traced: bool,
         needs_grad: bool, inputs_require_grad: bool) -> Any:
    """The forward of a checked call (`Backend.call`): the contract's torch expression where the
    compiler ``fused`` it, the op where ``traced``, the autograd function where it ``needs_grad``,
    else the body (without a graph where only inputs outside ``spec.differentiable`` require grad)."""
    kernel = spec.name
    if fused:
        return spec.forward(*values)  # the contract's torch expression, for Inductor to fuse
    if traced:
        # one op for the compiler to trace (or to run its fake implementation on meta tensors)
        if not spec.differentiable:
            values = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
        return registration.ops[kernel](*values)
    if needs_grad:
        return registration.functions[kernel](*values)
    if inputs_require_grad:
        # inputs outside ``spec.differentiable`` that require grad: the result carries no graph
        with torch.no_grad():
            return registration.kernels[kernel].forward(*values)
    return registration.kernels[kernel].forward(*values)


def _naming_bad_calls(kernel: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel method ``method`` raising `KernelInputError` naming the kernel and its
    parameters where its arguments do not bind (a misspelled keyword), for Python's bare
    TypeError. A TypeError raised inside the call passes through as it is."""

    @functools.wraps(method)
    def checked(self: Backend, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except TypeError as exc:
            # binding fails before the method's frame starts: the traceback ends here
            if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                raise
            raise KernelInputError(_bad_call(kernel, exc, args, kwargs)) from None

    return checked


def _bad_call(kernel: str, exc: TypeError, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``rms_norm: no parameter 'wieght' (did you mean 'weight'?); its parameters: ...``."""
    params = inspect.signature(SPECS[kernel].signature).parameters
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        close = difflib.get_close_matches(unknown[0], params, n=1)
        problem = f"no parameter {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    elif len(args) > len(params):
        problem = f"takes at most {len(params)} arguments, {len(args)} were given"
    else:  # Python's words without its qualified name: "missing 1 required positional argument: 'x'"
        problem = str(exc).split("() ", 1)[-1]
    listed = ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params.values())
    return f"{kernel}: {problem}; its parameters: {kernel}({listed})"


for _kernel in SPECS:
    setattr(Backend, _kernel, _naming_bad_calls(_kernel, getattr(KernelMethods, _kernel)))


def check_name(name: Any) -> None:
    """Raise `BackendError` unless ``name`` is a backend name (`NAME`)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BackendError(f"backend name {name!r} is not valid: expected lower-case letters and digits "
                           "in words joined by single hyphens, such as 'acme-npu'")


def _distributed(backend: Backend, values: list[Any]) -> list[Any] | None:
    """Where a tensor is a DTensor: ``values`` with every other tensor made a replicated DTensor
    on its mesh (a norm's weight, a loss's targets), for the op, which DTensor runs on each rank's
    shard by `kpt.distributed`'s rules (registered here the first time; a call compiled before
    any eager one finds them once ``kpt.distributed`` is imported). None where there is none. As
    under ``torch.compile``, index values are not checked: they would be read from every shard."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    mesh = next((v.device_mesh for v in values if isinstance(v, dtensor.DTensor)), None) if dtensor else None
    if mesh is None:
        return None
    from . import distributed

    distributed.register_rules(backend.op_namespace)
    return [distributed.replicated(v, mesh) for v in values]


def unknown_kernel(name: str) -> str:
    """Why ``name`` is not a kernel: the closest kernel names, then all of them."""
    close = difflib.get_close_matches(name, SPECS, n=3)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    return f"unknown kpt kernel {name!r}{hint}; the kernels: {', '.join(SPECS)}"


class _Registration(NamedTuple):
    """What registering a backend's ops made (`Backend.register_ops`): its kernel bodies, their
    custom ops, their eager autograd functions, and what the backend lacks (its bodies here raise)."""

    kernels: Mapping[str, Kernel]
    ops: dict[str, Any]
    functions: dict[str, Callable[..., Any]]
    missing: Mapping[str, tuple[str, ...]]


def _needs_grad(spec: KernelSpec, args: Mapping[str, Any]) -> bool:
    """Whether a differentiable input requires grad (grad mode is checked by the caller)."""
    for n in spec.differentiable:
        if isinstance(args[n], torch.Tensor) and args[n].requires_grad:
            return True
    return False


def missing_kernels(kernels: Mapping[str, Kernel]) -> dict[str, tuple[str, ...]]:
    """The contract kernels that ``kernels`` lacks, each with the bodies it lacks: ``("forward",
    "backward")`` for a differentiable kernel absent altogether, ``("forward",)`` for another,
    ``("backward",)`` for a differentiable kernel given without its backward."""
    missing: dict[str, tuple[str, ...]] = {}
    for name, spec in SPECS.items():
        if name not in kernels:
            missing[name] = ("forward", "backward") if spec.differentiable else ("forward",)
        elif spec.differentiable and kernels[name].backward is None:
            missing[name] = ("backward",)
    return missing


def describe_missing(missing: Mapping[str, tuple[str, ...]]) -> str:
    """``rms_norm (forward, backward), silu (backward)``: what `missing_kernels` found, in words."""
    return ", ".join(f"{name} ({', '.join(parts)})" for name, parts in missing.items())


PASSED_THROUGH = (KernelInputError, KernelNotSupportedError, BackendError, torch.OutOfMemoryError)
"""What a kernel body may raise as it is: kpt's own errors, and running out of device memory (a
condition of the machine that callers handle, not a fault of the backend); running out of host
memory too (`out_of_host_memory`)."""


def out_of_host_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's CPU allocator failing: a plain RuntimeError, where the device's
    allocator raises ``torch.OutOfMemoryError``."""
    return type(exc) is RuntimeError and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _guarded(backend: str, kernels: Mapping[str, Kernel]) -> dict[str, Kernel]:
    """Each body re-raising any other exception as a `BackendError` naming the backend, the kernel
    and the direction (the original is chained as its cause), so that a faulty plugin is told
    apart from a bad call."""

    def guard(kernel: str, part: str, body: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(body)
        def guarded(*args: Any) -> Any:
            try:
                return body(*args)
            except PASSED_THROUGH:
                raise
            except Exception as exc:
                if out_of_host_memory(exc):
                    raise
                raise BackendError(f"backend {backend!r} failed in {kernel} ({part}): "
                                   f"{type(exc).__name__}: {exc}") from exc

        return guarded

    return {name: Kernel(guard(name, "forward", k.forward),
                         None if k.backward is None else guard(name, "backward", k.backward))
            for name, k in kernels.items()}


def _with_missing_bodies(backend: str, kernels: Mapping[str, Kernel],
                         missing: Mapping[str, tuple[str, ...]]) -> dict[str, Kernel]:
    """``kernels`` completed with bodies that raise `BackendError` naming what the backend lacks."""

    def absent(kernel: str, part: str) -> Callable[..., Any]:
        def body(*args: Any) -> Any:
            raise BackendError(f"backend {backend!r} is missing kernel {kernel!r} ({part})")

        return body

    complete = dict(kernels)
    for name, parts in missing.items():
        given = kernels.get(name)
        forward = given.forward if given is not None else absent(name, "forward")
        complete[name] = Kernel(forward, absent(name, "backward") if "backward" in parts else None)
    return complete


# what a body misnamed for `kernels_from` tends to be called, and the name it must have
_NEAR_MISSES = {"_forward": "_fwd", "_backward": "_bwd"}


def kernels_from(*modules: types.ModuleType) -> dict[str, Kernel]:
    """Collect the kernel bodies of a backend's kernel modules, by name.

    For every kernel of the contract, ``<kernel>_fwd`` is its forward body and ``<kernel>_bwd``
    its backward body (differentiable kernels). When several modules define one, the last
    module given wins (a vendor's specialized module after the portable ones). Nothing is
    skipped without a word: a ``<kernel>_bwd`` without its ``<kernel>_fwd``, or a function
    named like a body under the other spelling (``<kernel>_forward``, ``<kernel>_backward``)
    raises `BackendError`.
    """
    found: dict[str, Kernel] = {}
    for name in SPECS:
        for module in modules:
            misnamed = [f"{name}{bad}" for bad in _NEAR_MISSES if hasattr(module, f"{name}{bad}")]
            if misnamed:
                good = [f"{name}{_NEAR_MISSES[m.removeprefix(name)]}" for m in misnamed]
                raise BackendError(f"{module.__name__}: {', '.join(misnamed)} look like kernel bodies; "
                                   f"kpt.kernels_from finds them only as {', '.join(good)}")
            fwd = getattr(module, f"{name}_fwd", None)
            bwd = getattr(module, f"{name}_bwd", None)
            if bwd is not None and fwd is None:
                raise BackendError(f"{module.__name__}: {name}_bwd has no {name}_fwd beside it")
            if fwd is not None:
                found[name] = Kernel(fwd, bwd)
    return found
