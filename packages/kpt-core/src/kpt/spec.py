"""How a kernel of the contract is described: `KernelSpec`, its conformance `Case`s and `BadInput`s.

Every kernel of ``docs/contract.md`` has exactly one `KernelSpec`, defined in the module of its family
under ``kpt/kernels/``. A spec holds everything core knows about a kernel:

* ``signature``: the public Python function (its signature and docstring are what users see
  as ``backend.<kernel>``; its body is never called);
* ``validate``: the input checks, raising `KernelInputError`, returning the arguments in order;
* ``forward`` / ``backward``: the reference math, pure PyTorch, exact in float64, named
  ``<kernel>_fwd`` / ``<kernel>_bwd`` in the family's module as every backend names its bodies
  (`kpt.kernels_from` finds them). They are also the *kernel-body contract*: a backend's
  ``<kernel>_fwd`` takes the same arguments and returns the same tuple (public ``outputs`` then
  ``saved`` tensors); its ``<kernel>_bwd`` takes the forward arguments, every forward output
  (public and saved) and one gradient per public output (``None`` where autograd has none), and
  returns one gradient per ``differentiable`` input (an empty tensor where that input was
  ``None``);
* ``flops`` and `KernelSpec.min_bytes`: the cost model used by benchmarks (each input read
  once, each output written once);
* ``cases`` / ``bad_inputs``: what the conformance suite runs;
* ``check_indices`` / ``bad_indices``: for kernels with index-like inputs (targets, expert ids,
  offsets, permutations), the *index checks* that read those values from the device, and the
  out-of-range calls (`BadIndices`) that exercise them. "Index checks" is the one word for this
  idea everywhere: a call runs them inside `checking_indices` (or under ``KPT_CHECK_INDICES=1``),
  or by default on a backend whose `Backend.checks_indices` is true;
* ``sharding``: how the kernel runs on DTensor shards (`Strategy`, used by `kpt.distributed`);
* ``memory_bound`` and ``peers``: what benchmarks and speed bars compare the kernel with;
* ``rounding``, ``kink`` and ``alternative_gradients``: where the conformance check
  (`kpt.testing.check_backward`) accepts more than the float64 oracle's gradients, because the
  contract allows a rounding, a side of a kink, or a second result.

Nothing else in core lists kernels: every other table is derived from ``kpt.SPECS``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import KernelInputError

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""The activation dtypes every backend supports (the reference backend adds float64)."""

Args = dict[str, Any]
MakeInputs = Callable[[torch.Generator, torch.dtype], Args]

PARTIAL = "partial"
"""In a `Strategy`: a partial sum (each rank holds a share of the value, the sum of the shares)."""

Placement = int | str
"""In a `Strategy`: a dimension ``d`` (the tensor sharded over it) or `PARTIAL`."""

Strategy = tuple[dict[str, Placement], dict[str, Placement]]
"""One way to run a kernel on shards: placements of its outputs (public then saved) and of its
tensor inputs, by name; a tensor not named is replicated. Written without torch.distributed's
types so that the contract does not import it; `kpt.distributed` translates."""

Sharding = Callable[[Args], list[Strategy]]
"""A kernel's forward strategies, given its arguments by name (a tensor as DTensor's spec of it:
``ndim``, ``shape``, ``placements``, ``mesh``); the all-replicated strategy is implied."""

RoundingAllowance = Callable[[Args, Args, torch.dtype], dict[str, torch.Tensor]]
"""Per-element absolute error a kernel's gradients may carry beyond the tolerance, from a rounding
that the contract permits and a bound relative to the result cannot hold (it is amplified where
terms cancel): called with the checked float64 arguments of the oracle, the upstream gradients
(``d`` and the output's name) and the dtype under test, it returns float64 allowances by input
name."""

Kink = Callable[[Args, Args, Args, torch.dtype], dict[str, torch.Tensor]]
"""A second oracle for a kernel whose derivative jumps somewhere (relu's at 0): the gradients on
the side the backend's forward took, where its rounding allows either. Called with the oracle's
checked arguments, the upstream gradients, the backend's forward outputs (by name) and the dtype
under test; returns float64 gradients by input name."""

AlternativeGradients = Callable[[Args, Args], dict[str, torch.Tensor]]
"""A second oracle of a kernel's gradients, for calls where the contract allows two results (as
attention's for a non-finite value in pairs its causal mask hides): called with the checked
float64 arguments of the oracle and the upstream gradients, it returns float64 gradients by input
name."""


def no_sharding(args: Args) -> list[Strategy]:
    """The default `Sharding`: replicated inputs only (a sharded DTensor input is refused, naming
    its placement)."""
    return []


def each_dim(dims: Sequence[int], outputs: Sequence[str], inputs: Sequence[str],
             stats: Sequence[str] = ()) -> list[Strategy]:
    """Strategies with the same dimension of ``inputs`` and ``outputs`` sharded, one for each of
    ``dims``; the flattened row statistics ``stats`` then go sharded over their rows (dimension 0)."""
    return [({**{o: d for o in outputs}, **{s: 0 for s in stats}}, {i: d for i in inputs}) for d in dims]


def leading_dims(outputs: tuple[str, ...], inputs: tuple[str, ...], stats: tuple[str, ...] = ()) -> Sharding:
    """The `Sharding` of a kernel that reduces over the last dimension only (normalizations): any
    leading dimension of ``inputs[0]`` sharded."""
    return lambda a: each_dim(range(a[inputs[0]].ndim - 1), outputs, inputs, stats)


@dataclass(frozen=True)
class Case:
    """One conformance case: ``make(generator, dtype)`` draws fresh random CPU inputs.

    ``perf`` marks the large shapes of docs/performance.md used by performance tests; ``large``
    another shape of a real workload too large for the CPU profiles (interpreters, simulators).
    Both are `device_only`. ``dtypes`` restricts the case to some activation dtypes. ``grad`` runs
    the backward check too (only for differentiable kernels).
    """

    name: str
    make: MakeInputs
    grad: bool = True
    perf: bool = False
    dtypes: tuple[torch.dtype, ...] | None = None
    tolerance_scale: float = 1.0
    """Widens every tolerance for an ill-conditioned case, where the float32 reference itself
    errs by more than the table allows (its spec says why)."""
    eager_factor: float = 0.0
    """Marks an ill-conditioned case, where float32 arithmetic itself (PyTorch eager included)
    errs beyond the table: a result then also passes within this many times the error of the
    reference math run in the dtype under test, against float64 (`kpt.testing.eager_widened`)."""
    description: str = ""
    """What the case probes, for a reader of a failure ("inputs scaled by 1e-4"); the name alone
    when empty."""
    large: bool = False
    """A shape of a real workload too large for the CPU profiles; last, so that positional
    arguments keep their places."""

    @property
    def device_only(self) -> bool:
        """A perf or large case: its numerics run only on a real device, in bfloat16, never where
        the backend computes on CPU tensors; only perf cases are timed."""
        return self.perf or self.large


@dataclass(frozen=True)
class BadInput:
    """An invalid call and the error it must raise; ``make()`` builds the CPU arguments."""

    name: str
    make: Callable[[], Args]
    error: type[Exception] = KernelInputError


@dataclass(frozen=True)
class BadIndices:
    """A call whose shapes and dtypes are valid but whose index values are not: ``arg`` holds a
    value out of range (or, for a permutation, repeated). Checked mode must raise a
    `KernelInputError` naming ``arg``; without checks the kernel must still stay inside its
    tensors and give the contract's defined result for such values."""

    name: str
    make: Callable[[], Args]
    arg: str


@dataclass(frozen=True)
class KernelSpec:
    """The contract of one kernel (see the module docstring)."""

    name: str
    signature: Callable[..., Any]
    validate: Callable[[Args, tuple[torch.dtype, ...]], Args]
    forward: Callable[..., tuple[torch.Tensor, ...]]
    outputs: tuple[str, ...]
    flops: Callable[[Args], float]
    cases: Callable[[], list[Case]]
    bad_inputs: Callable[[], list[BadInput]]
    backward: Callable[..., tuple[torch.Tensor, ...]] | None = None
    saved: tuple[str, ...] = ()
    differentiable: tuple[str, ...] = ()
    needs_grad_arg: bool = False
    """When true the forward takes a trailing ``needs_grad: bool`` (set by core: does any
    differentiable input require grad?) so that it can prepare gradients while it runs."""
    grads: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] | None = None
    """Maps the backward's results to one gradient per differentiable input, where two inputs
    share one gradient tensor (custom ops may not return the same tensor twice)."""
    unsaved: tuple[str, ...] = ()
    """Tensor inputs the backward never reads (what it needs, the forward saved): autograd does
    not keep them alive, and the backward gets None in their place."""
    reusable: tuple[str, ...] = ()
    """Saved outputs the backward may overwrite and return as gradients (gradients the forward
    prepared, which nothing else reads), so that scaling them costs no second tensor."""
    check_indices: Callable[[Args], None] | None = None
    """Checks the values of index-like inputs (reading them from the device), raising
    `KernelInputError` at the first offending position; run where values are checked."""
    bad_indices: Callable[[], list[BadIndices]] = lambda: []
    sharding: Sharding = no_sharding
    """The forward op's DTensor strategies; the backward op's are derived from them."""
    memory_bound: bool = False
    """Moves its bytes once (norms, activations, row-wise losses, fp8 scaling): speed is held to a
    fraction of the copy bandwidth."""
    peers: tuple[str, ...] = ()
    """Libraries that implement the same kernel, compared with it by `kpt.bench` (``"liger"``, ``"flag_gems"``)."""
    rounding: RoundingAllowance | None = None
    """The rounding of the gradients the contract permits beyond the tolerance, and its bound."""
    kink: Kink | None = None
    """The second oracle at a kink of the derivative; `kpt.testing.check_backward` always uses it."""
    alternative_gradients: AlternativeGradients | None = None
    """The second oracle where the contract allows two results for special values; the conformance
    fuzzing uses it for calls that hold them."""

    def min_bytes(self, args: Args, outputs: tuple[torch.Tensor, ...]) -> int:
        """Each tensor input read once and each public output written once."""
        tensors = [v for v in args.values() if isinstance(v, torch.Tensor)]
        return nbytes(*tensors, *outputs[: len(self.outputs)])

    _signature: inspect.Signature = field(init=False, repr=False, compare=False)
    _parameters: tuple[tuple[str, ...], dict[str, Any]] | None = field(init=False, repr=False, compare=False)
    """Names and defaults, when every parameter is positional-or-keyword (then `bind` skips
    ``inspect``, which costs more than the rest of a call's host time)."""

    def __post_init__(self) -> None:
        # computed here, not lazily: a functools.cached_property takes a lock on Python < 3.12,
        # which torch.compile cannot trace (a kernel compiled before its first eager call)
        signature = inspect.signature(self.signature)
        params = signature.parameters.values()
        fast = None
        if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
            fast = tuple(p.name for p in params), {p.name: p.default for p in params if p.default is not p.empty}
        object.__setattr__(self, "_signature", signature)
        object.__setattr__(self, "_parameters", fast)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Args:
        """Match a call to the public signature, defaults applied; a wrong call is a KernelInputError."""
        fast = self._parameters
        if fast is not None and len(args) <= len(fast[0]):
            names, defaults = fast
            if not kwargs and len(args) == len(names):  # every argument given in order: the kernel methods' call
                return dict(zip(names, args))
            bound = dict(zip(names, args))
            unused = len(kwargs)
            for n in names[len(args):]:
                if n in kwargs:
                    bound[n] = kwargs[n]
                    unused -= 1
                elif n in defaults:
                    bound[n] = defaults[n]
                else:
                    break
            else:
                if not unused:
                    return bound
        try:  # a call the fast path does not take, or a wrong one: inspect names the problem
            call = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise KernelInputError(f"{self.name}: {exc}") from None
        call.apply_defaults()
        return dict(call.arguments)

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any], dtypes: tuple[torch.dtype, ...]) -> Args:
        """Bind a call and validate it: the arguments in the forward's order, normalized."""
        return self.validate(self.bind(args, kwargs), dtypes)

    def forward_values(self, checked: Args, needs_grad: bool) -> list[Any]:
        """The forward's positional arguments: the checked ones, plus ``needs_grad`` if it takes it."""
        return [*checked.values(), needs_grad] if self.needs_grad_arg else list(checked.values())


# ---------------------------------------------------------------------------------------------
# Index checks: whether index values are read and checked before a kernel runs.

_CHECK_INDICES: ContextVar[bool | None] = ContextVar("kpt_check_indices", default=None)


@contextlib.contextmanager
def checking_indices(enabled: bool = True) -> Iterator[None]:
    """Inside, every call checks the values of its index-like inputs (``True``) or none does
    (``False``), whatever the backend's default and ``$KPT_CHECK_INDICES``.

    A check reads the values back to the host (a device synchronization), so GPU backends check
    only when asked: ``with kpt.checking_indices(): ...`` or ``KPT_CHECK_INDICES=1``. Backends whose
    `Backend.checks_indices` is true (the reference, the FPGA simulator) check by default. Calls
    traced by ``torch.compile`` are not checked (a check would read the device inside the graph).
    """
    token = _CHECK_INDICES.set(enabled)
    try:
        yield
    finally:
        _CHECK_INDICES.reset(token)


def indices_checked(backend_default: bool) -> bool:
    """Whether a call checks index values now: `checking_indices` if inside one, else the
    backend's default or ``$KPT_CHECK_INDICES``."""
    enabled = _CHECK_INDICES.get()
    if enabled is not None:
        return enabled
    return backend_default or os.environ.get("KPT_CHECK_INDICES", "") not in ("", "0")


# ---------------------------------------------------------------------------------------------
# Input checks shared by every spec. Each raises KernelInputError naming kernel and argument.


class Check:
    """Input checks for one call of ``kernel``; ``dtypes`` are the backend's activation dtypes."""

    def __init__(self, kernel: str, dtypes: Sequence[torch.dtype]) -> None:
        self.kernel = kernel
        self.dtypes = tuple(dtypes)

    def fail(self, arg: str, message: str) -> KernelInputError:
        return KernelInputError(f"{self.kernel}: argument '{arg}' {message}")

    def tensor(
        self,
        arg: str,
        t: Any,
        *,
        ndim: int | None = None,
        min_ndim: int = 0,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> torch.Tensor:
        """A tensor of an allowed dtype (default: the backend's float dtypes) and rank."""
        if not isinstance(t, torch.Tensor):
            raise self.fail(arg, f"must be a torch.Tensor, got {type(t).__name__}")
        allowed = self.dtypes if dtypes is None else tuple(dtypes)
        if t.dtype not in allowed:
            names = ", ".join(dict.fromkeys(str(d).removeprefix("torch.") for d in allowed))
            raise self.fail(arg, f"has dtype {t.dtype}; expected one of: {names}")
        rank = t.dim()
        if ndim is not None and rank != ndim:
            raise self.fail(arg, f"must have {ndim} dimensions, got shape {tuple(t.shape)}")
        if rank < min_ndim:
            raise self.fail(arg, f"must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
        return t

    def param(self, arg: str, t: Any, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
        """An optional parameter (norm weight, bias): float32 or ``like``'s dtype, given shape."""
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or (t.dtype is not like.dtype and t.dtype is not torch.float32):
            self.tensor(arg, t, dtypes=(like.dtype, torch.float32))  # raises, naming the allowed dtypes
        self.shape(arg, t, shape)
        self.same_device(arg, t, like)
        return t

    def shape(self, arg: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
        """``t`` has the shape ``expected`` (a tuple or a ``torch.Size``)."""
        if t.shape != expected:
            raise self.fail(arg, f"has shape {tuple(t.shape)}; expected {tuple(expected)}")

    def same_dtype(self, arg: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
        if t.dtype != like.dtype:
            raise self.fail(arg, f"has dtype {t.dtype} but '{like_name}' has {like.dtype}; they must match")

    def same_device(self, arg: str, t: torch.Tensor, like: torch.Tensor) -> None:
        if t.device != like.device:
            raise self.fail(arg, f"is on {t.device} but the other inputs are on {like.device}")

    def choice(self, arg: str, value: Any, options: Sequence[Any]) -> Any:
        if value not in options:
            raise self.fail(arg, f"is {value!r}; expected one of {list(options)!r}")
        return value

    def values_in(self, arg: str, t: torch.Tensor, low: int, high: int, bound: str,
                  allowed: int | None = None) -> None:
        """Every value of the index tensor ``t`` in ``[low, high)`` (or equal to ``allowed``);
        ``bound`` names where ``high`` comes from. Reads ``t`` from its device."""
        bad = (t < low) | (t >= high)
        if allowed is not None:
            bad &= t != allowed
        if bool(bad.any()):
            at = [int(i) for i in bad.nonzero()[0]]
            extra = f" or {allowed} (ignored)" if allowed is not None else ""
            raise self.fail(arg, f"has {int(t[tuple(at)])} at {at}; expected values in [{low}, {high}) "
                                 f"({bound}){extra}")

    def number(self, arg: str, value: Any, *, low: float = -math.inf, high: float = math.inf,
               integer: bool = False) -> Any:
        """A number in ``[low, high]`` that the ops' schema holds: an int64 if ``integer``, else an
        int or float that converts to a float64 (``2**2000`` does not)."""
        kind = int if integer else (int, float)
        what = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, kind) or not (low <= value <= high):
            raise self.fail(arg, f"is {_short(value)}; expected {what} in [{low}, {high}]")
        if integer and not -(2**63) <= value < 2**63:
            raise self.fail(arg, f"is {_short(value)}, outside the int64 range the kernels take")
        if not integer and isinstance(value, int) and abs(value) > sys.float_info.max:
            raise self.fail(arg, f"is an integer of {value.bit_length()} bits, too large for a float64")
        return value


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (an integer of 2000 bits has 600 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Helpers for reference math and for drawing conformance inputs.


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reference math runs in: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows(t: torch.Tensor) -> torch.Tensor:
    """Flatten every leading dimension: ``[..., D] -> [rows, D]`` (zero-size dims allowed); a 2-D
    tensor is returned as it is (a reshape to its own shape costs a launcher microseconds of host)."""
    if t.dim() == 2:
        return t
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values (times ``scale``) drawn from ``g``, rounded to ``dtype``."""
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other column of a wider buffer)."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values and shape in a dense column-major layout (the transpose of a contiguous
    transpose): elementwise torch ops keep that layout, so it catches non-contiguous outputs."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


ROW_SHAPES: dict[str, tuple[int, ...]] = {
    "llm": (4, 32, 4096),
    "single_row": (1, 64),
    "one_element": (1, 1),
    "odd": (3, 17),
    "wide": (17, 1000),
    "long_row": (2, 4097),
}
"""Shapes of the row-wise kernels' conformance cases: typical, then the odd sizes 1, 3, 17, 1000, 4097,
and a row of one element, which a kernel tiled for wider rows may hold in one lane, or in every lane
of a warp."""


def finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its infinities and NaNs (special input values and what they reach) as 0."""
    return torch.where(torch.isfinite(t), t, 0.0)


def neighbors(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``dtype`` values just below and just above each element of the float64 ``t`` (both
    ``t`` where ``dtype`` holds it; ``dtype``'s exponent range is not bounded here)."""
    if dtype == torch.float64:
        return t, t
    info = torch.finfo(dtype)
    # t = m · 2^e with 0.5 <= |m| < 1: the step of dtype in t's binade, its subnormal step below
    step = (torch.ldexp(torch.ones_like(t), torch.frexp(t).exponent - 1) * info.eps).clamp_min(info.tiny * info.eps)
    below = torch.floor(t / step) * step
    return below, torch.where(below == t, t, below + step)


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def row_cases(make: Callable[..., Args], perf_shape: tuple[int, ...], *, extreme: bool = True,
              extreme_tolerance_scale: float = 1.0) -> list[Case]:
    """The standard cases of a row-wise kernel.

    ``make(g, dtype, shape=..., scale=1.0, layout=identity)`` draws the inputs of one call for
    activations of ``shape``, multiplied by ``scale``, passed through ``layout`` (`strided` for
    the non-contiguous case).
    """

    def case(name: str, **kw: Any) -> Case:
        perf = kw.pop("perf", False)
        scale = extreme_tolerance_scale if name in ("huge", "tiny") else 1.0
        layout = "non-contiguous rows, " if kw.get("layout") is strided else ""
        scaled = f", inputs scaled by {kw['scale']:g}" if "scale" in kw else ""
        description = f"{layout}shape {kw['shape']}{scaled}"
        return Case(name, lambda g, dtype: make(g, dtype, **kw), perf=perf, tolerance_scale=scale,
                    description=description)

    cases = [case(name, shape=shape) for name, shape in ROW_SHAPES.items()]
    cases += [
        case("strided", shape=(33, 1024), layout=strided),
        case("zero_rows", shape=(0, 512)),
        case("zero_cols", shape=(4, 0)),
    ]
    if extreme:
        cases += [case("huge", shape=(8, 2048), scale=1e3), case("tiny", shape=(8, 2048), scale=1e-4)]
    cases.append(case("perf", shape=perf_shape, perf=True))
    return cases
