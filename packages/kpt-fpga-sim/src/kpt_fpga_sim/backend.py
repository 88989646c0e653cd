"""`FpgaSimBackend`: the simulator as a kpt backend, its configuration and its reports.

    be = kpt.get_backend("fpga-sim")                      # float32, Alveo U250, 300 MHz
    fx = kpt_fpga_sim.configure(be, format=ap_fixed(16, 6, "RND", "SAT"), device="u280",
                                clock_mhz=250, directives={"linear": {"reuse": 4}})
    y = fx.linear(x, w)
    print(fx.last_report)            # what that call would cost on the U280
    print(fx.report_table())         # every call since the last clear_reports()

Every call runs the kernel's body (the numbers) and evaluates its design (the cost); the
`kpt_fpga_sim.hls.Report` is appended to ``reports``, with the overflow counts of the call.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kpt import SPECIAL_VALUES, Backend, Kernel, PerfBar, Tolerance, default_tolerance, kernels_from
from kpt.kernels import SPECS
from kpt.ops import as_tuple
from kpt.testing import oracle_backend, to_oracle

from . import kernels as kernel_modules
from .config import SimConfig, from_environment, make_config
from .devices import OpCost
from .formats import ApFixed, Format
from .hls import Report, evaluate, format_table
from .sim import FLOAT_ONLY, Call, running

MAX_REPORTS = 10_000
_instances = itertools.count()

MATMUL_KERNELS = ("linear", "grouped_linear", "fp8_linear")


@dataclass(frozen=True)
class DesignBar:
    """What the default design of a kernel promises on a large enough shape (its docs/performance.md shape):
    the initiation interval of its main loop and the fraction of the device's compute roof."""

    ii: int = 1
    min_compute_roof_fraction: float = 0.70


class FpgaSimBackend(Backend):
    name = "fpga-sim"
    vendor = "kpt"
    device_type = "cpu"
    simulator = True
    # a simulated design has no defined behavior for out-of-range index values; on the CPU
    # checking them costs nothing
    checks_indices = True

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or from_environment()
        self.reports: deque[Report] = deque(maxlen=MAX_REPORTS)
        self._instance = next(_instances)

    def __repr__(self) -> str:
        return f"<kpt backend 'fpga-sim' ({self.config.describe()})>"

    @property
    def op_namespace(self) -> str:
        # every configured instance registers its own custom ops
        return f"kpt_fpga_sim_{self._instance}"

    @property
    def conformance_profile(self) -> str:
        return "fpga-sim-fixed" if self.config.fixed else "fpga-sim"

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "fpga_sim": self.config.describe()}

    # -- kernels ----------------------------------------------------------------------------

    def kernels(self) -> dict[str, Kernel]:
        bodies = kernels_from(*kernel_modules.FAMILIES)
        return {
            name: Kernel(self._traced(name, "forward", k.forward),
                         None if k.backward is None else self._traced(name, "backward", k.backward))
            for name, k in bodies.items()
        }

    def _traced(self, kernel: str, direction: str, body: Callable[..., Any]) -> Callable[..., Any]:
        design = kernel_modules.design_function(kernel, direction)

        def run(*args: Any) -> Any:
            with running(Call(kernel, self.config)) as call:
                out = body(*args)
            self.reports.append(self._report(call, design(call, *args), direction, call.arith.overflows))
            return out

        run.__name__ = f"{kernel}_{direction}"
        return run

    def _report(self, call: Call, design: Any, direction: str, overflows: Mapping[str, int]) -> Report:
        report = evaluate(design, call.config.device, call.config.clock_mhz, str(call.config.format),
                          call.ops, direction, call.directives.changed())
        report.overflows.update(overflows)
        return report

    def estimate(self, kernel: str, *args: Any, **kwargs: Any) -> Report:
        """The report of a forward call of ``kernel`` without running it (``meta`` tensors do)."""
        spec = SPECS[kernel]
        values = spec.forward_values(spec.check(args, kwargs, self.dtypes), False)
        call = Call(kernel, self.config)
        return self._report(call, kernel_modules.design_function(kernel, "forward")(call, *values),
                            "forward", {})

    # -- reports ----------------------------------------------------------------------------

    @property
    def last_report(self) -> Report | None:
        return self.reports[-1] if self.reports else None

    def report_table(self, last: int | None = None) -> str:
        reports = list(self.reports)[-last:] if last else list(self.reports)
        return format_table(reports)

    def clear_reports(self) -> None:
        self.reports.clear()

    # -- conformance --------------------------------------------------------------------------

    def unsupported(self, kernel: str, args: Mapping[str, Any]) -> str | None:
        if not self.config.fixed or kernel in FLOAT_ONLY:
            return None
        dtypes = {v.dtype for v in args.values() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
        if dtypes - {torch.float32}:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            return (f"fixed-point mode ({self.config.format}) takes float32 activations only, "
                    f"got {names}")
        return None

    def _fixed_format(self, kernel: str) -> ApFixed | None:
        """The fixed-point format ``kernel`` computes in; None in float32 mode and for the
        kernels that compute in floats in every mode."""
        fmt = self.config.format
        return fmt if isinstance(fmt, ApFixed) and kernel not in FLOAT_ONLY else None

    def special_values(self, kernel: str, dtype: torch.dtype) -> tuple[str, ...]:
        """A kernel that computes in a fixed-point format saturates infinities and flushes
        subnormals: it is fuzzed with finite values of its range only."""
        return SPECIAL_VALUES if self._fixed_format(kernel) is None else ()

    def fuzzed_gradients(self, kernel: str) -> bool:
        """Not in a fixed-point format: its gradient tolerance (`call_tolerance`) is derived for the
        contract's cases, and fuzzed shapes outside them exceed it (a 2-wide layer_norm row's dx,
        relu linear's dweight at K = 257: 10-19x); the forward results of fuzzed calls are checked."""
        return self._fixed_format(kernel) is None

    def beyond_format(self, kernel: str, args: Mapping[str, Any]) -> str | None:
        """In a fixed-point format: data beyond its range or all below its LSB (`data_scale`), outputs
        beyond its range (the contract's in float64: they saturate), and a normalization's row whose
        scale σ is so few LSB that its ``y`` cannot be resolved (`smallest_sigma` below the σ of
        `NORMALIZATION_FLOOR_AT_MOST`): the kinds of data of the conformance cases this format
        declares failures (``huge``, ``tiny``, ``eps_comparable``)."""
        fmt = self._fixed_format(kernel)
        if fmt is None:
            return None
        if data_scale(fmt, args, PROBABILITY_INPUTS.get(kernel, ())) is None:
            return f"data beyond {fmt}'s range or below its LSB"
        top = fmt.max_raw * fmt.lsb
        outputs = as_tuple(oracle_backend().call(kernel, **{n: to_oracle(v) for n, v in args.items()}))
        if any(o.is_floating_point() and o.numel() and float(o.abs().max()) > top for o in outputs):
            return f"an output beyond {fmt}'s range (|y| <= {top:g})"
        if kernel in NORMALIZATIONS:
            sigma, least = smallest_sigma(kernel, args), normalization_min_sigma(kernel, fmt)
            if sigma is not None and sigma <= least:
                return f"a row of scale σ = {sigma:.3g}, at most {least:.3g} ({least / fmt.lsb:.0f} LSB of {fmt})"
        return None

    def tolerance(self, kernel: str, dtype: torch.dtype) -> Tolerance | None:
        fmt = self._fixed_format(kernel)
        return None if fmt is None else fixed_tolerance(kernel, fmt)

    def call_tolerance(self, kernel: str, dtype: torch.dtype, args: Mapping[str, Any],
                       output: str) -> Tolerance | None:
        """`tolerance` for one call's ``output`` (`kpt.testing` asks this where it knows the
        arguments; for a gradient they include the upstream gradients). In fixed mode, an output
        computed through a weight of fan-in K is allowed that weight's quantization error,
        `weight_roundings` (K), where it exceeds the kernel's ``ROUNDINGS``; and every output is
        allowed those roundings at the scale of the call's data as an absolute error
        (`data_scale`), however small the output itself turns out; a normalization's ``y`` at the
        scale its rows amplify them to (`normalization_gain`) where that is larger."""
        fmt = self._fixed_format(kernel)
        if fmt is None:
            return None
        roundings: float = ROUNDINGS[kernel]
        through = FAN_IN_WEIGHTS.get(kernel)
        if through is not None and output in through[1]:
            roundings = max(roundings, weight_roundings(args[through[0]].shape[-1]))
        scale = data_scale(fmt, args, PROBABILITY_INPUTS.get(kernel, ()))
        if scale is not None and kernel in NORMALIZATIONS and output == "y":
            scale = max(scale, normalization_gain(kernel, args, normalization_min_sigma(kernel, fmt)))
        return fixed_tolerance(kernel, fmt, roundings, scale)

    def perf_bar(self, kernel: str, mode: str) -> PerfBar:
        """Simulation speed against the reference backend on the conformance shapes: measured and
        reported by the conformance suite, not promised (CPU timing is not stable enough to gate)."""
        return PerfBar(cases="conformance")

    def design_bar(self, kernel: str) -> DesignBar | None:
        """The II and roofline promise of ``kernel``'s default design (matrix products only)."""
        return DesignBar() if kernel in MATMUL_KERNELS else None


CONTRACTION_ROUNDINGS = 32
"""A sum of K products of unit-scale data with N(0, 1/K) weights, each operand rounded (error
uniform within ±r), errs with a standard deviation of r·√(K/3): 13 r at K = 512, 32 r at
K = 3072. The kernel-wide bound covers short sums; `weight_roundings` grows it with K."""

WEIGHT_SIGMAS = 4
"""How many standard deviations of the weight-quantization error `weight_roundings` allows."""

FAN_IN_WEIGHTS = {
    "linear": ("weight", ("y", "dx")),
    "grouped_linear": ("weight", ("y", "dx_sorted")),
    "linear_cross_entropy": ("weight", ("loss", "dhidden")),
}
"""Per kernel: its weight of fan-in K (the last dimension), drawn N(0, 1/K) so that the outputs
are of unit scale, and the outputs computed through it."""


def weight_roundings(fan_in: int) -> float:
    """Roundings of r that the quantization of a weight of fan-in K brings to an output computed
    through it, in `WEIGHT_SIGMAS` standard deviations.

    A weight drawn N(0, 1/K) and rounded (error uniform within ±r, standard deviation r/√3) errs
    by r·√(K/3) relative to its own scale, and so does every output linear in it: a forward
    y = x·Wᵀ sums K such errors times unit-scale x (r·√(K/3) on a unit-scale y), a gradient
    dx = dy·W sums N of them times dy, on a dx of scale √(N/K). At K = 4097 that is 37 r (the 4σ
    bound 148 r); the kernel-wide 32 of `CONTRACTION_ROUNDINGS` covers 4σ up to K = 192.
    """
    return WEIGHT_SIGMAS * math.sqrt(fan_in / 3)

# Not a `kpt.KernelSpec` field: these count the roundings of this simulator's own fixed-point
# designs (their declared intermediates, guard bits and lookup tables), not a fact of the contract.
ROUNDINGS = {
    "rms_norm": 8, "add_rms_norm": 8, "layer_norm": 8, "softmax": 4, "gelu": 6, "silu": 6, "swiglu": 8,
    "geglu": 8, "rope": 4, "cross_entropy": 8, "moe_combine": 8,
    "attention": CONTRACTION_ROUNDINGS, "linear": CONTRACTION_ROUNDINGS,
    "linear_cross_entropy": CONTRACTION_ROUNDINGS, "grouped_linear": CONTRACTION_ROUNDINGS,
}
"""Roundings of r (½ LSB for RND modes, 1 LSB for TRN) that reach an output of each kernel,
forward and backward: every operand's quantization times its weight in the result (≤ 1-2 for
unit-scale data), the declared intermediates (4 guard bits: 1/16 each), the table units (under
1 LSB of F + 4 bits) and the output's own rounding; contractions per `CONTRACTION_ROUNDINGS`."""


PROBABILITY_INPUTS = {"softmax": ("x",), "cross_entropy": ("logits",)}
"""Inputs that reach the outputs only through exp(z − max z), i.e. as probabilities of at most
1: their magnitude does not scale the error (it would hide a wrong gradient of a mean loss)."""


def data_scale(fmt: ApFixed, args: Mapping[str, Any], probabilities: tuple[str, ...] = ()) -> float | None:
    """The scale of a call's data: the largest magnitude among its floating-point tensors (the
    inputs, and for a gradient the upstream gradients), where `ROUNDINGS` assume 1; inputs named
    in ``probabilities`` count as 1. None when the format does not hold the data: a value beyond
    its range saturates (an error no count of roundings bounds; the call's report counts the
    overflow), and data all below one LSB round to nothing."""
    magnitudes = {n: float(v.detach().abs().max()) for n, v in args.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()}
    if any(m > fmt.max_raw * fmt.lsb for m in magnitudes.values()):
        return None
    largest = max((1.0 if n in probabilities else m for n, m in magnitudes.items()), default=0.0)
    return largest if largest >= fmt.lsb else None


NORMALIZATIONS = ("rms_norm", "add_rms_norm", "layer_norm")
"""The kernels whose output ``y`` divides each row by its own scale (`normalization_gain`)."""

NORMALIZATION_FLOOR_AT_MOST = 0.25
"""The largest absolute floor a normalization's gain may give its ``y``, as a fraction of max|w|
(the scale of y): a y a quarter of its scale off still fails. Rows of smaller σ keep the floor at
the data's scale and remain the format's failures (the conformance cases ``tiny`` and
``eps_comparable``, whose σ of 0.001 to 0.004 is a few LSB of ap_fixed<16,6>)."""


def normalization_gain(kernel: str, args: Mapping[str, Any], min_sigma: float = 0.0) -> float:
    """How much a normalization's ``y`` moves per unit change of an element of its input, at most:
    max|weight| / σ of the call's smallest row (in float64, from the call's arguments).

    Each row h is normalized by its own scale σ = √(mean(h²) + eps), y = h / σ · weight, where
    h = x (rms_norm), x + residual (add_rms_norm) or x − mean(x) (layer_norm, σ its std). A
    rounding of an element of h by r moves that element of y by r·|w|/σ, and moves σ by at most
    r, which moves y by r·|y|/σ besides. `ROUNDINGS` counts such roundings for rows of unit scale
    (σ ≈ 1); a row that nearly cancels (x + residual ≈ 0) amplifies each of them by 1/σ: at
    σ = 0.02 the rounding of ap_fixed<16,6>'s h (r = 2^-11) moves y by 0.024·|w|, not 0.0005·|w|.
    The tolerance is one per call, so its smallest row sets it.

    0 for a call without elements, and where that row's σ is at most ``min_sigma``: the caller
    passes the σ below which the floor would exceed `NORMALIZATION_FLOOR_AT_MOST` of max|w|, the
    scale of y itself, and so would check little or nothing."""
    sigma = smallest_sigma(kernel, args)
    if sigma is None or sigma <= min_sigma:
        return 0.0
    weight = SPECS[kernel].bind((), dict(args))["weight"]
    return (1.0 if weight is None else float(weight.detach().abs().max())) / sigma


def smallest_sigma(kernel: str, args: Mapping[str, Any]) -> float | None:
    """The scale σ of a normalization call's smallest row (in float64, from the contract's own
    ``rstd``); None for a call without elements."""
    spec = SPECS[kernel]
    bound = {n: v.detach().to(torch.float64) if isinstance(v, torch.Tensor) else v
             for n, v in spec.bind((), dict(args)).items()}
    if bound["x"].numel() == 0:
        return None
    rstd = spec.forward(*spec.forward_values(bound, False))[-1]  # the contract's 1 / σ of each row
    return 1.0 / float(rstd.max())


def normalization_min_sigma(kernel: str, fmt: ApFixed) -> float:
    """The σ below which a normalization's gain would give ``y`` a floor above
    `NORMALIZATION_FLOOR_AT_MOST` of its scale (`normalization_gain`)."""
    return ROUNDINGS[kernel] * rounding(fmt) / NORMALIZATION_FLOOR_AT_MOST


UNSCALED_ROUNDINGS = 2
"""Roundings of r that reach an output at full weight however small the call's data: the output's
own, and the inputs' carried through the kernel's slope, about 1 where the data are small (silu'
is 0.5 at 0, gelu' at most 1.08 for |x| ≤ 1). A silu of one element x = -0.00145 in
ap_fixed<16,6,RND,SAT> (r = 2^-11) rounds x by 0.97 r, which moves y by 0.48 r, then rounds y by
a full r: 1.48 r off, more than one rounding however small S."""


def rounding(fmt: ApFixed) -> float:
    """The largest error of one rounding to ``fmt``: ½ LSB where it rounds, 1 LSB where it truncates."""
    return fmt.lsb / 2 if fmt.rounds else fmt.lsb


def fixed_tolerance(kernel: str, fmt: ApFixed, roundings: float | None = None,
                    scale: float | None = None) -> Tolerance:
    """The conformance tolerance of fixed mode: ``roundings`` (default ``ROUNDINGS[kernel]``)
    roundings of r, as an absolute error on outputs of unit scale (so also relative to them).

    With the scale S of the call's data (`data_scale`; for a normalization's ``y``, its
    `normalization_gain` where larger) it also states the absolute error those roundings amount
    to, ``abs_floor`` = r · (`UNSCALED_ROUNDINGS` + roundings · S): each rounding counted for
    unit-scale data weighs at most the largest magnitude it is multiplied by, S, while the output's
    own rounding and the inputs' weigh about 1 whatever S is. So an output far below the data's
    scale (a lone small value, a gradient times a small upstream gradient, a mean over many rows)
    is allowed the error of the computation that produced it, not one relative to its own
    smallness."""
    r = rounding(fmt)
    n = ROUNDINGS[kernel] if roundings is None else roundings
    bound = n * r
    base = default_tolerance(torch.float32)
    floor = r * (UNSCALED_ROUNDINGS + n * scale) if scale else 0.0
    return Tolerance(
        rel_norm=max(base.rel_norm, bound), atol=max(base.atol, bound), rtol=max(base.rtol, bound),
        reason=(f"{fmt}: {n:.3g} roundings of {r:g} ({'½ LSB' if fmt.rounds else '1 LSB'}, 1 LSB = 2^-{fmt.f}) "
                f"reach an output of {kernel}, for outputs of unit scale"
                + (f"; at least {floor:.3g} for roundings weighing up to {scale:.3g}" if floor else "")),
        abs_floor=floor,
    )


def configure(backend: FpgaSimBackend | None = None, *, format: Format | str | None = None,
              device: str | None = None, clock_mhz: float | None = None,
              directives: Mapping[str, Mapping[str, Any]] | None = None,
              operators: Mapping[str, OpCost] | None = None) -> FpgaSimBackend:
    """A new simulator backend: ``backend``'s configuration (default: the environment's) with
    the given number format, device profile ("u250", "u280", "zynq7020"), clock, per-kernel
    directives (``{"linear": {"reuse": 4}}``, see `kpt_fpga_sim.config`) and operator-library
    calibration replaced."""
    base = backend.config if backend is not None else from_environment()
    return FpgaSimBackend(make_config(base, format=format, device=device, clock_mhz=clock_mhz,
                                      directives=directives, operators=operators))
