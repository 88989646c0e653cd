"""Property-based fuzzing of valid calls: every kernel against the float64 oracle on random shapes,
layouts, dtypes and special values.

Hypothesis draws one valid call of a kernel at a time:

* **shapes** from `SIZES` (0, 1, primes, powers of two and their neighbours) and, for the row
  length, a few larger ones (`ROW_SIZES`), every dimension the contract relates kept consistent;
* **layouts** per tensor (`LAYOUTS`): contiguous, transposed (column-major), sliced (every other
  column of a wider buffer), at a storage offset, or expanded (a stride of 0 over the first
  dimension: every row the same; float tensors only, index values stay as drawn);
* **dtypes**: each of the backend's, and the optional arguments' choices (a float32 norm weight
  beside bfloat16 activations, a bias or none, every enum value);
* **special values** (`kpt.SPECIAL_VALUES`, those `kpt.Backend.special_values` takes) written into one
  float input: ±0, subnormals, ±max, ±inf, NaN.

A call whose data the backend's number format cannot hold or resolve (`kpt.Backend.beyond_format`:
a fixed-point design's declared failures) is not drawn.

The result must match the float64 oracle within the backend's tolerance, with the contract's rule
for special values (`kpt.kernels`, "Special values"): a NaN or infinity of the inputs reaches
exactly the outputs the reference math carries it to, and an output may be non-finite beyond
that only where the reference math run at the contract's precision (float32 for the float16,
bfloat16 and float32 inputs) overflows too, with the same value; an output that a ±max input
reaches and that overflows in float32 (that math's or the backend's) where float64's does not is
open (a sum's order is not fixed). No input may change. The
gradients of the differentiable kernels are checked as well, also with special values
(`SPECIAL_GRADIENTS`); attention's may match, per element, either the reference's dense products or
a second oracle in which the pairs its causal mask hides add nothing
(`kpt.KernelSpec.alternative_gradients`). A valid call that the backend does not support may raise
`kpt.KernelNotSupportedError`.

Bounded by ``--kpt-fuzz-valid-examples`` calls per kernel (CI runs the default; ``nox -s fuzz``
many more). Hypothesis's choices come from the run's seed, so ``kpt check --seed N`` replays
them; a failure prints the drawn call (shapes, strides, dtype, special value) and hypothesis's
reproduction blob.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, note, seed, settings
from hypothesis import strategies as st

import kpt
from kpt.ops import as_tuple
from kpt.spec import transposed
from kpt.testing import (
    check_backward,
    compare,
    eager_widened,
    either,
    modified,
    oracle_backend,
    poisoned,
    snapshot,
    to_oracle,
    tolerance_for,
)
from kpt_conformance.plugin import run_of

SIZES = (0, 1, 2, 3, 5, 7, 13, 16, 17, 31, 32, 33, 63, 64, 65)
"""Sizes of every dimension: empty, one, primes, powers of two and their neighbours."""
ROW_SIZES = (*SIZES, 127, 128, 257, 1000)
"""Sizes of the dimension a row-wise kernel reduces over, up to what the interpreter runs fast."""
ATTENTION_SCALES = (None, 0.02, 0.0)
"""The default D^-0.5, a flat softmax, a uniform one. Larger scales make the softmax sharp, which the
contract's own cases probe with their tolerance (``huge_scores``: 4x the table): at scale 1 a bfloat16
dk errs up to 1.13x the table."""
BATCH = (0, 1, 2, 3)
"""Sizes of a second leading dimension or a batch: the tensors stay within what the interpreter runs fast."""
HEAD_DIMS = (16, 24, 32, 64)
OVERFLOWING = ("max", "inf", "nan")
"""Special values with which float32 arithmetic may overflow where float64 does not (`_expected`)."""
SPECIAL_GRADIENTS = ("zero", "subnormal", "inf", "nan")
"""Special values with which the gradients are checked too; not ±max, for which the contract allows
float32 overflow in the forward's named intermediates only."""
LAYOUTS = ("contiguous", "transposed", "sliced", "offset", "expanded")
NOT_EXPANDED = {
    ("linear_cross_entropy", "weight"): "every class the same row: dhidden = Σ_c dz_c · w cancels to 0 exactly, "
                                        "and a kernel that rounds dz to the activations' dtype before its product "
                                        "(as fused losses do) leaves that rounding, beyond any relative bound",
}
"""Arguments never drawn "expanded", and why."""
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
EAGER_FACTOR = 2.0
"""Random shapes and scales make some draws ill-conditioned (attention's softmax made sharp by a
scale of 1, a long cancelling sum): every call also passes within this many times the error of the
reference math run in the dtype under test, as the contract's ill-conditioned cases do
(`kpt.Case.eager_factor`, `kpt.testing.eager_widened`)."""
PHASES = (Phase.explicit, Phase.generate)
"""No shrinking: on a simulator each call takes seconds and a shrink hundreds of them; the failing
call is printed in full (and replays with the run's seed) instead."""


class Inputs:
    """What one call's builder draws from: its sizes, float tensors and choices."""

    def __init__(self, draw: Any, dtype: torch.dtype) -> None:
        self.draw, self.dtype = draw, dtype
        self.g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        self.dims: dict[str, int] = {}
        self.special_targets: list[torch.Tensor] = []

    def size(self, name: str, sizes: tuple[int, ...] = SIZES) -> int:
        """The size of the dimension ``name``, the same wherever the call names it."""
        if name not in self.dims:
            self.dims[name] = self.draw(st.sampled_from(sizes), label=name)
        return self.dims[name]

    def lead(self) -> tuple[int, ...]:
        """One or two leading dimensions (flattened into rows by the row-wise kernels)."""
        if self.choice("lead dims", (1, 2)) == 1:
            return (self.size("rows"),)
        return self.size("b", BATCH), self.size("rows")

    def choice(self, label: str, options: Any) -> Any:
        return self.draw(st.sampled_from(tuple(options)), label=label)

    def floats(self, *shape: int, dtype: torch.dtype | None = None, scale: float = 1.0,
               special: bool = True) -> torch.Tensor:
        """Standard-normal values times ``scale``; ``special``: may receive the call's special values."""
        t = (torch.randn(*shape, generator=self.g, dtype=torch.float64) * scale).to(dtype or self.dtype)
        if special:
            self.special_targets.append(t)
        return t

    def weight(self, *shape: int) -> torch.Tensor:
        """A weight of fan-in ``shape[-1]``, N(0, 1/K): outputs of unit scale."""
        return self.floats(*shape, scale=max(shape[-1], 1) ** -0.5)

    def param(self, n: int) -> torch.Tensor | None:
        """An optional norm weight or bias: none, in the activations' dtype, or float32."""
        kind = self.choice("param", ("none", "same", "float32"))
        return None if kind == "none" else self.floats(n, dtype=torch.float32 if kind == "float32" else None)

    def fp8(self, *shape: int) -> torch.Tensor:
        fp8_dtype = self.choice("fp8 dtype", FP8)
        fmax = torch.finfo(fp8_dtype).max
        return (torch.randn(*shape, generator=self.g) * fmax / 8).clamp(-fmax, fmax).to(fp8_dtype)

    def scales(self, label: str, *rows: int, magnitude: float) -> torch.Tensor:
        """Positive float32 scales: one per row (``[*rows, 1]``) or per tensor (``[]``), as drawn."""
        shape = (*rows, 1) if self.choice(label, ("row", "tensor")) == "row" else ()
        return ((torch.rand(shape, generator=self.g, dtype=torch.float64) + 0.5) * magnitude).to(torch.float32)

    def ints(self, high: int, *shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.randint(0, max(high, 1), shape, generator=self.g).to(dtype)


def _rows(i: Inputs) -> tuple[int, ...]:
    return (*i.lead(), i.size("d", ROW_SIZES))


def _norm(i: Inputs, residual: bool = False, bias: bool = False) -> dict[str, Any]:
    x = i.floats(*_rows(i))
    args = {"x": x, **({"residual": i.floats(*x.shape)} if residual else {}), "weight": i.param(x.shape[-1])}
    return {**args, **({"bias": i.param(x.shape[-1])} if bias else {}), "eps": i.choice("eps", (1e-6, 1e-5, 1.0))}


def _gated(i: Inputs) -> dict[str, Any]:
    shape = _rows(i)
    return {"gate": i.floats(*shape), "up": i.floats(*shape)}


def _rope(i: Inputs) -> dict[str, Any]:
    b, s, d = i.size("b", BATCH), i.size("s"), 2 * i.size("half", (1, 2, 3, 8, 16, 32, 33))
    cs = (s, d) if i.choice("cos rank", (2, 3)) == 2 else (b, s, d)
    return {"q": i.floats(b, i.size("hq", BATCH), s, d), "k": i.floats(b, i.size("hk", BATCH), s, d),
            "cos": i.floats(*cs, special=False), "sin": i.floats(*cs, special=False)}


def _attention(i: Inputs) -> dict[str, Any]:
    b, hkv, group = i.size("b", BATCH[1:]), i.size("hkv", (1, 2)), i.size("group", (1, 2, 3))
    d = i.choice("d", HEAD_DIMS)
    sq, skv = i.size("sq"), i.size("skv")
    return {"q": i.floats(b, hkv * group, sq, d), "k": i.floats(b, hkv, skv, d), "v": i.floats(b, hkv, skv, d),
            "causal": i.choice("causal", (False, True)), "scale": i.choice("scale", ATTENTION_SCALES)}


def _linear(i: Inputs) -> dict[str, Any]:
    k, n = i.size("k", ROW_SIZES), i.size("n")
    return {"x": i.floats(*i.lead(), k), "weight": i.weight(n, k), "bias": i.param(n),
            "activation": i.choice("activation", (None, "relu", "gelu", "gelu_tanh", "silu"))}


def _targets(i: Inputs, n: int, classes: int) -> torch.Tensor:
    target = i.ints(classes, n, dtype=torch.int64)
    ignored = torch.rand(n, generator=i.g) < i.choice("ignored share", (0.0, 0.3, 1.0))
    return torch.where(ignored | (classes == 0), -100, target)  # no class to take: every row ignored


def _cross_entropy(i: Inputs) -> dict[str, Any]:
    n, v = i.size("rows"), i.size("v", ROW_SIZES)
    return {"logits": i.floats(n, v), "target": _targets(i, n, v), "ignore_index": -100,
            "label_smoothing": i.choice("label_smoothing", (0.0, 0.1, 1.0)),
            "reduction": i.choice("reduction", ("mean", "sum", "none"))}


def _linear_cross_entropy(i: Inputs) -> dict[str, Any]:
    n, k, v = i.size("rows"), i.size("k"), i.size("v", ROW_SIZES)
    return {"hidden": i.floats(n, k), "weight": i.weight(v, k), "target": _targets(i, n, v), "bias": i.param(v),
            "ignore_index": -100, "reduction": i.choice("reduction", ("mean", "sum", "none"))}


def _moe_gating(i: Inputs) -> dict[str, Any]:
    e = i.size("experts", SIZES[1:])
    return {"logits": i.floats(i.size("tokens"), e), "k": i.choice("k", range(1, min(e, 8) + 1)),
            "renormalize": i.choice("renormalize", (True, False))}


def _moe_dispatch(i: Inputs) -> dict[str, Any]:
    t, e = i.size("tokens"), i.size("experts", SIZES[1:])
    return {"x": i.floats(t, i.size("hidden", ROW_SIZES)), "indices": i.ints(e, t, i.size("k", (1, 2, 3, 8))),
            "num_experts": e}


def _grouped_linear(i: Inputs) -> dict[str, Any]:
    m, e, k = i.size("rows"), i.size("experts", SIZES[1:]), i.size("k")
    offsets = torch.sort(torch.randint(0, m + 1, (e + 1,), generator=i.g)).values
    if i.choice("offsets span", ("all rows", "some rows")) == "all rows":
        offsets[0], offsets[-1] = 0, m
    return {"x_sorted": i.floats(m, k), "offsets": offsets.to(torch.int32), "weight": i.weight(e, i.size("n"), k)}


def _moe_combine(i: Inputs) -> dict[str, Any]:
    t, k = i.size("tokens"), i.size("k", (1, 2, 3, 8))
    weights = i.floats(t, k, dtype=i.choice("weights dtype", (torch.float32, i.dtype)))
    return {"y_sorted": i.floats(t * k, i.size("hidden", ROW_SIZES)),
            "order": torch.randperm(t * k, generator=i.g).to(torch.int32), "weights": weights}


def _quantize(i: Inputs) -> dict[str, Any]:
    return {"x": i.floats(*_rows(i)), "granularity": i.choice("granularity", ("tensor", "row")),
            "fp8_dtype": i.choice("fp8_dtype", FP8)}


def _dequantize(i: Inputs) -> dict[str, Any]:
    xq = i.fp8(*_rows(i))
    return {"xq": xq, "scale": i.scales("granularity", *xq.shape[:-1], magnitude=2.0 / torch.finfo(xq.dtype).max),
            "dtype": i.dtype}


def _fp8_linear(i: Inputs) -> dict[str, Any]:
    k, n, lead = i.size("k", ROW_SIZES), i.size("n"), i.lead()
    xq, wq = i.fp8(*lead, k), i.fp8(n, k)
    mx, mw = (8.0 / torch.finfo(t.dtype).max / max(k, 1) ** 0.25 for t in (xq, wq))
    bias = i.choice("bias", ("none", "out_dtype", "float32"))
    return {"xq": xq, "x_scale": i.scales("x_scale", *lead, magnitude=mx),
            "wq": wq, "w_scale": i.scales("w_scale", n, magnitude=mw),
            "bias": None if bias == "none" else i.floats(n, dtype=torch.float32 if bias == "float32" else i.dtype),
            "out_dtype": i.dtype}


BUILDERS = {
    "rms_norm": _norm,
    "add_rms_norm": lambda i: _norm(i, residual=True),
    "layer_norm": lambda i: _norm(i, bias=True),
    "softmax": lambda i: (lambda x: {"x": x, "dim": i.choice("dim", range(-x.dim(), x.dim()))})(i.floats(*_rows(i))),
    "gelu": lambda i: {"x": i.floats(*_rows(i)), "approximate": i.choice("approximate", ("none", "tanh"))},
    "silu": lambda i: {"x": i.floats(*_rows(i))},
    "swiglu": _gated,
    "geglu": lambda i: {**_gated(i), "approximate": i.choice("approximate", ("none", "tanh"))},
    "rope": _rope,
    "attention": _attention,
    "linear": _linear,
    "cross_entropy": _cross_entropy,
    "linear_cross_entropy": _linear_cross_entropy,
    "moe_gating": _moe_gating,
    "moe_dispatch": _moe_dispatch,
    "grouped_linear": _grouped_linear,
    "moe_combine": _moe_combine,
    "quantize_fp8": _quantize,
    "dequantize_fp8": _dequantize,
    "fp8_linear": _fp8_linear,
}
"""Per kernel: a valid call drawn from `Inputs` (contiguous CPU tensors; layouts come after). A
kernel without one is fuzzed with its own conformance cases (`valid_calls`)."""


def _write_special(t: torch.Tensor, kind: str, g: torch.Generator) -> None:
    """Write special values of ``kind`` into the contiguous tensor ``t``: a whole row of ±0 or of
    subnormals, or ±max, ±inf or NaN at up to two places."""
    if not t.numel():
        return
    info = torch.finfo(t.dtype)
    flat = t.view(-1, t.shape[-1]) if t.dim() > 1 else t.view(1, -1)
    if kind in ("zero", "subnormal"):
        row = flat[int(torch.randint(flat.shape[0], (1,), generator=g))]
        signs = torch.where(torch.rand(row.shape, generator=g) < 0.5, -1.0, 1.0)
        magnitude = 0.0 if kind == "zero" else info.tiny * torch.rand(row.shape, generator=g, dtype=torch.float64)
        row.copy_(signs * magnitude)
        return
    value = {"max": info.max, "inf": float("inf"), "nan": float("nan")}[kind]
    for place in torch.randint(t.numel(), (2,), generator=g).tolist():
        sign = -1.0 if bool(torch.rand((), generator=g) < 0.5) else 1.0
        t.view(-1)[place] = sign * value


def _layout(t: torch.Tensor, layout: str, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` in ``layout`` (see `LAYOUTS`); "expanded" repeats its first row."""
    if layout == "transposed" and t.dim() >= 2:
        return transposed(t).to(device)
    if layout == "sliced" and t.dim() >= 1:
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=device)
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "offset":
        buffer = torch.empty(t.numel() + 3, dtype=t.dtype, device=device)
        buffer[3:] = t.reshape(-1)
        return buffer[3:].view(t.shape)
    if layout == "expanded" and t.dim() >= 1 and t.shape[0] > 1 and t.is_floating_point():
        return t[:1].to(device).expand(t.shape)
    return t.to(device)


@st.composite
def valid_calls(draw: Any, spec: kpt.KernelSpec, dtypes: tuple[torch.dtype, ...], backend: kpt.Backend) -> tuple:
    """(dtype, special value or None, layouts, CPU arguments, seed of the output gradients) of one
    valid call of ``spec``."""
    dtype = draw(st.sampled_from(dtypes), label="dtype")
    inputs = Inputs(draw, dtype)
    if spec.name in BUILDERS:
        args = BUILDERS[spec.name](inputs)
    else:  # a kernel without a builder of its own: one of its conformance cases, drawn afresh
        cases = [c for c in spec.cases() if not c.device_only and (c.dtypes is None or dtype in c.dtypes)]
        made = draw(st.sampled_from(cases), label="case").make(inputs.g, dtype)
        args = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in made.items()}
        inputs.special_targets += [v for v in args.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    special = draw(st.sampled_from((None, None, *backend.special_values(spec.name, dtype))), label="special values")
    if special is not None and inputs.special_targets:
        target = draw(st.sampled_from(range(len(inputs.special_targets))), label="special values' input")
        _write_special(inputs.special_targets[target], special, inputs.g)
    layouts = {name: draw(st.sampled_from([k for k in LAYOUTS
                                           if k != "expanded" or (spec.name, name) not in NOT_EXPANDED]),
                          label=f"layout of {name}")
               for name, v in args.items() if isinstance(v, torch.Tensor)}
    # the gradients' seed continues the inputs' generator: a seed hypothesis drew twice would make
    # the upstream gradient equal to an input (dy = x: layer_norm's dx cancels to nothing)
    return dtype, special, layouts, args, int(torch.randint(2**31, (), generator=inputs.g))


def _describe(spec: kpt.KernelSpec, dtype: torch.dtype, special: str | None, args: dict) -> str:
    parts = [f"{k}={list(v.shape)} {str(v.dtype).removeprefix('torch.')} stride {v.stride()} "
             f"offset {v.storage_offset()}" if isinstance(v, torch.Tensor) else f"{k}={v!r}" for k, v in args.items()]
    return f"{spec.name}({', '.join(parts)}) in {dtype}, special values: {special or 'none'}"


def _expected(out: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, reach: torch.Tensor | None) -> torch.Tensor:
    """What ``out`` is judged against when the call holds ±max, ±inf or NaN: per element the
    oracle ``ref``, or the reference math at the contract's precision (``low``, which may
    overflow where float64 does not) where ``out`` is nearer to it: the same infinity or NaN,
    or a finite value nearer (`kpt.testing.either`). With ±max, where an output the ±max values
    ``reach`` overflows in float32 (``low`` or ``out`` is inf or NaN) and the oracle is finite,
    ``out`` itself: the contract leaves the order of a sum open, and another order overflows
    elsewhere, differently (inf for NaN) or not at all."""
    expected = either(out, ref, low)
    if reach is None:
        return expected
    o = out.detach().to(torch.float64)
    low, ref = low.to(o.device, torch.float64), ref.to(o.device, torch.float64)  # float8 has no isfinite
    overflowed = reach.to(o.device) & torch.isfinite(ref) & ~(torch.isfinite(low) & torch.isfinite(o))
    return torch.where(overflowed, o, expected)


def _reach_of_max(oracle: kpt.Backend, spec: kpt.KernelSpec, args: dict) -> tuple[torch.Tensor, ...]:
    """Per output, which elements depend on an input's ±max: the oracle with those values as NaN."""
    def as_nan(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dtype in FP8:
            return to_oracle(v)
        return torch.where(v.abs() == torch.finfo(v.dtype).max, float("nan"), to_oracle(v))
    return tuple(torch.isnan(t) for t in as_tuple(oracle.call(spec.name, **{k: as_nan(v) for k, v in args.items()})))


def _check(backend: kpt.Backend, spec: kpt.KernelSpec, device: torch.device, call: tuple, backward: bool) -> None:
    dtype, special, layouts, cpu_args, grad_seed = call
    args = {k: _layout(v, layouts[k], device) if isinstance(v, torch.Tensor) else v for k, v in cpu_args.items()}
    # data the backend's number format cannot hold or resolve (as laid out: an expanded input repeats
    # its first row): its declared failures, not drawn
    assume(backend.beyond_format(spec.name, args) is None)
    note(_describe(spec, dtype, special, args))
    before = snapshot(args)
    try:
        with poisoned():
            outs = as_tuple(backend.call(spec.name, **args))
    except kpt.KernelNotSupportedError:
        outs = ()
    problems = modified(args, before)
    oracle = oracle_backend()
    refs = as_tuple(oracle.call(spec.name, **{k: to_oracle(v) for k, v in args.items()})) if outs else ()
    lows = as_tuple(oracle.call(spec.name, **args)) if outs else ()
    reaches = _reach_of_max(oracle, spec, args) if outs and special == "max" else (None,) * len(outs)
    for name, out, ref, low, reach in zip(spec.outputs, outs, refs, lows, reaches):
        if not out.is_contiguous():
            problems.append(f"output '{name}' is not contiguous")
        if out.dtype != low.dtype:
            problems.append(f"output '{name}' has dtype {out.dtype}, expected {low.dtype}")
        if special in OVERFLOWING and out.is_floating_point() and ref.is_floating_point():
            ref = _expected(out, ref, low, reach)
        tol = tolerance_for(backend, spec.name, dtype, out, 1.0, args, name)
        comparison = compare(name, out, ref, eager_widened(tol, name, low.to(out.device), ref, EAGER_FACTOR))
        if not comparison.ok:
            problems.append(comparison.message)
    if outs and (special is None or special in SPECIAL_GRADIENTS) and backward and not problems:
        report = check_backward(backend, spec, args, dtype, torch.Generator().manual_seed(grad_seed),
                                eager_factor=EAGER_FACTOR,
                                alternative=spec.alternative_gradients if special else None)
        problems += [f"backward: {report.message}"] if not report.ok else []
    assert not problems, f"{_describe(spec, dtype, special, args)}: {'; '.join(problems)}"


@pytest.mark.parametrize("spec", list(kpt.SPECS.values()), ids=list(kpt.SPECS))
def test_valid_calls_match_the_oracle(request: pytest.FixtureRequest, backend: kpt.Backend,
                                      device: torch.device, spec: kpt.KernelSpec, record_property) -> None:
    record_property("kpt", {"kernel": spec.name, "kind": "forward", "case": "fuzzed valid calls"})
    config = request.config
    # gradients too where the kernel has them and the backend its backward (a missing one is its
    # presence test's failure, not this test's)
    backward = (bool(spec.differentiable) and "backward" not in run_of(config).missing.get(spec.name, ())
                and backend.fuzzed_gradients(spec.name))
    run = settings(max_examples=config.getoption("--kpt-fuzz-valid-examples"), deadline=None, database=None,
                   print_blob=True, phases=PHASES, suppress_health_check=list(HealthCheck))(
        given(call=valid_calls(spec, run_of(config).dtypes, backend))(
            lambda call: _check(backend, spec, device, call, backward)))
    seed(run_of(config).seed(request.node.nodeid))(run)()
