"""Checking a backend against the float64 oracle: the engine of the conformance suite.

Vendors can use it in their own unit tests too::

    from kpt.testing import check_forward
    report = check_forward(backend, kpt.SPECS["rms_norm"], args, torch.bfloat16)
    assert report.ok, report.message

The oracle is the reference backend run on float64 copies of the inputs (on the same device). Outputs of
the backend are *poisoned*: while it runs, every new tensor is filled with NaN (integers with
their largest value), so an element a kernel forgets to write shows up as NaN, and NaN never
passes. Inputs are compared bit for bit before and after the call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .backend import Backend
from .ops import as_tuple
from .spec import AlternativeGradients, Args, KernelSpec, finite
from .tolerance import Tolerance, default_tolerance

_EXACT_FLOAT = (torch.float8_e4m3fn, torch.float8_e5m2)


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Fill every tensor allocated inside with NaN / the largest integer (``torch.empty`` included)."""
    import torch.utils.deterministic as det

    was_det, was_warn, was_fill = (torch.are_deterministic_algorithms_enabled(),
                                   torch.is_deterministic_algorithms_warn_only_enabled(),
                                   det.fill_uninitialized_memory)  # type: ignore[attr-defined]  # not in torch's stubs
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        det.fill_uninitialized_memory = was_fill  # type: ignore[attr-defined]
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)


@dataclass
class Comparison:
    """How one tensor compares with the oracle; ``worst`` is the largest error/tolerance ratio."""

    name: str
    ok: bool
    worst: float
    message: str = ""


@dataclass
class CheckReport:
    kernel: str
    comparisons: list[Comparison] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.comparisons)

    @property
    def worst(self) -> float:
        return max((c.worst for c in self.comparisons), default=0.0)

    @property
    def message(self) -> str:
        return "; ".join(self.problems + [c.message for c in self.comparisons if not c.ok])


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, tol: Tolerance,
            allowance: torch.Tensor | None = None) -> Comparison:
    """Compare ``out`` with the oracle ``ref`` (see `kpt.tolerance` for the rule); differences up
    to ``allowance`` (per element, in the output's units: a rounding the contract permits, see
    `KernelSpec.rounding`) are not counted."""
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(name, False, math.inf, f"{name}: shape {tuple(out.shape)} != expected {tuple(ref.shape)}")
    out, ref = out.detach(), ref.detach().to(out.device)
    if not out.is_floating_point() and not ref.is_floating_point():
        bad = int((out.to(torch.int64) != ref.to(torch.int64)).sum())
        return Comparison(name, bad == 0, float(bad > 0), f"{name}: {bad} of {out.numel()} integers differ")
    # the output dtype's spacing near zero (float16 subnormals): no result in it can be closer
    quantum = torch.finfo(out.dtype).tiny * torch.finfo(out.dtype).eps if out.is_floating_point() else 0.0
    o, r = out.to(torch.float64), ref.to(torch.float64)
    nan = torch.isnan(o) & ~torch.isnan(r)
    if bool(nan.any()):
        return Comparison(name, False, math.inf,
                          f"{name}: {int(nan.sum())} NaN of {o.numel()} (unwritten or invalid elements)")
    if o.numel() == 0:
        return Comparison(name, True, 0.0)
    same_inf = torch.isinf(r) & (o == r)
    err = torch.where(same_inf | (torch.isnan(o) & torch.isnan(r)), 0.0, (o - r).abs())
    finite_r = torch.where(torch.isfinite(r), r, 0.0)
    scale = float(finite_r.abs().max())
    err = (err - quantum).clamp_min(0.0)
    if allowance is not None:
        err = (err - finite(allowance.to(err.device, torch.float64))).clamp_min(0.0)
    allowed = max(tol.atol * scale, tol.abs_floor) + tol.rtol * finite_r.abs()
    elem = float((err / allowed.clamp_min(torch.finfo(torch.float64).tiny)).max())
    norm_ref = float(torch.linalg.vector_norm(finite_r))
    rel = float(torch.linalg.vector_norm(err)) / norm_ref if norm_ref > 0 else float(err.max())
    # the floor on every element allows an error norm of abs_floor·√n
    rel_norm = max(tol.rel_norm, tol.abs_floor * math.sqrt(o.numel()) / norm_ref) if norm_ref > 0 else tol.rel_norm
    worst = max(elem, rel / rel_norm)
    ok = worst <= 1.0 and math.isfinite(worst)
    floor = f", at least {tol.abs_floor:.3g}" if tol.abs_floor else ""
    msg = "" if ok else (f"{name}: relative error norm {rel:.3g} (allowed {rel_norm:.3g}); worst element "
                         f"at {elem:.3g}x its tolerance (atol {tol.atol:.3g}*max|ref|{floor}, rtol {tol.rtol:.3g})")
    return Comparison(name, ok, worst, msg)


def either(out: torch.Tensor, ref: torch.Tensor, alt: torch.Tensor) -> torch.Tensor:
    """What ``out`` is judged against where the contract allows two results: per element the
    second one, ``alt``, where ``out`` is nearer to it than to ``ref``, else ``ref`` (float64).

    The same infinity, or NaN beside NaN, is at distance 0; a value's distance to a different
    infinity or to NaN is infinite. So ``out`` passes where it matches either result by the usual
    rule (`compare`), a NaN of ``out`` only where one of the two is NaN, and where the two agree
    ``out`` must match them."""
    o = out.detach().to(torch.float64)
    ref, alt = (t.detach().to(o.device).to(torch.float64) for t in (ref, alt))

    def distance(r: torch.Tensor) -> torch.Tensor:
        same = (o == r) | (torch.isnan(o) & torch.isnan(r))
        gap = (o - r).abs()
        return torch.where(same, 0.0, torch.where(torch.isnan(gap), math.inf, gap))

    return torch.where(distance(alt) < distance(ref), alt, ref)


def tolerance_for(backend: Backend, kernel: str, dtype: torch.dtype, out: torch.Tensor,
                  scale: float = 1.0, args: Args | None = None, output: str = "") -> Tolerance:
    """The backend's declared tolerance (`Backend.call_tolerance` when the call's ``args`` and the
    compared ``output``'s name are given), else the default table's for the dtype under test
    (float8 outputs use the float8 row: their rounding dominates), widened by the case's scale.
    For a gradient, `check_backward` adds the upstream gradients to ``args``, each named ``d``
    and its output's name (``dy``)."""
    key = out.dtype if out.dtype in _EXACT_FLOAT else dtype
    declared = (backend.tolerance(kernel, key) if args is None
                else backend.call_tolerance(kernel, key, args, output))
    tol = declared or default_tolerance(key)
    return tol if scale == 1.0 else tol.scaled(scale, f"case x{scale}")


def eager_widened(tol: Tolerance, name: str, eager: torch.Tensor, ref: torch.Tensor, factor: float) -> Tolerance:
    """``tol`` for an ill-conditioned case (`kpt.Case.eager_factor`): widened so that a result
    within ``factor`` times the error of ``eager`` (the reference math run in the dtype under
    test, as PyTorch eager computes it) against the float64 oracle ``ref`` passes, measured by
    the same rule (`compare`'s worst error over tolerance). Never narrowed below ``tol``; an
    eager result that is not finite where the oracle is widens nothing."""
    worst = compare(name, eager, ref, tol).worst
    if not factor or not math.isfinite(worst) or factor * worst <= 1.0:
        return tol
    widened = tol.scaled(factor * worst, f"ill-conditioned: {factor:g}x eager's error in the same dtype")
    if ref.numel() and float(finite(ref.detach().to(torch.float64)).abs().max()) == 0:
        # an oracle of exact zeros (a cancellation: smoothed cross-entropy of equal logits) scales no
        # bound relative to it: eager's largest error, times factor, is allowed as a floor instead
        err = finite(eager.detach().to(torch.float64) - ref.detach().to(eager.device, torch.float64)).abs().max()
        widened = replace(widened, abs_floor=max(widened.abs_floor, factor * float(err)))
    return widened


def _eager_inputs(args: Args, grad_names: Sequence[str] = ()) -> Args:
    return {k: (v.detach().requires_grad_(k in grad_names) if isinstance(v, torch.Tensor) else v)
            for k, v in args.items()}


def to_oracle(v: Any) -> Any:
    """A float64 copy of a floating tensor (float8 kept as it is, integers as they are), on the
    same device: a GPU computes the oracle of real-size cases far faster than the CPU."""
    if not isinstance(v, torch.Tensor):
        return v
    v = v.detach()
    return v.to(torch.float64) if v.is_floating_point() and v.dtype not in _EXACT_FLOAT else v.clone()


def to_device(args: Args, device: torch.device) -> Args:
    """Move the tensors to ``device``, keeping non-contiguous layouts non-contiguous."""
    moved = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor) and v.device != device:
            base = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=device)
            v = base.copy_(v)
        moved[k] = v
    return moved


def snapshot(args: Args) -> dict[str, torch.Tensor]:
    """Copies of the tensor arguments, to tell later whether a call modified them (`modified`)."""
    return {k: v.detach().clone() for k, v in args.items() if isinstance(v, torch.Tensor)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    # a copy with dense strides: a tensor with a dimension of size 0 or 1 counts as contiguous
    # whatever its strides, and a view as bytes needs a last stride of 1
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def modified(args: Args, before: dict[str, torch.Tensor]) -> list[str]:
    """What differs, bit for bit, between the tensors of ``args`` and their `snapshot`."""
    changed = []
    for k, v in before.items():
        now = args[k].detach()
        if now.shape != v.shape or not torch.equal(_bits(now), _bits(v)):
            changed.append(f"input '{k}' was modified")
    return changed


def oracle_backend() -> Backend:
    from .registry import get_backend

    return get_backend("reference")


def check_forward(backend: Backend, spec: KernelSpec, args: Args, dtype: torch.dtype,
                  tolerance_scale: float = 1.0, eager_factor: float = 0.0) -> CheckReport:
    """Run ``spec`` on ``backend`` (inputs already on its device) and compare with the oracle;
    with ``eager_factor``, also allow that many times the error of eager (`eager_widened`)."""
    report = CheckReport(spec.name)
    before = snapshot(args)
    with poisoned():
        outs = as_tuple(backend.call(spec.name, **args))
    refs = as_tuple(oracle_backend().call(spec.name, **{k: to_oracle(v) for k, v in args.items()}))
    # the reference on meta tensors gives the exact dtypes the contract promises
    metas = as_tuple(oracle_backend().call(spec.name, **{k: _meta(v) for k, v in args.items()}))
    eagers = as_tuple(oracle_backend().call(spec.name, **_eager_inputs(args))) if eager_factor else refs
    report.problems += modified(args, before)
    for name, out, ref, meta, eager in zip(spec.outputs, outs, refs, metas, eagers):
        if not out.is_contiguous():
            report.problems.append(f"output '{name}' is not contiguous")
        if out.dtype != meta.dtype:
            report.problems.append(f"output '{name}' has dtype {out.dtype}, expected {meta.dtype}")
        tol = tolerance_for(backend, spec.name, dtype, out, tolerance_scale, args, name)
        report.comparisons.append(compare(name, out, ref, eager_widened(tol, name, eager, ref, eager_factor)))
    return report


def _meta(v: Any) -> Any:
    return v.detach().to("meta") if isinstance(v, torch.Tensor) else v


def check_backward(backend: Backend, spec: KernelSpec, args: Args, dtype: torch.dtype,
                   generator: torch.Generator, tolerance_scale: float = 1.0, eager_factor: float = 0.0,
                   alternative: AlternativeGradients | None = None) -> CheckReport:
    """Gradients through ``backend`` for random output gradients (in each output's dtype, the
    oracle's as well), against the float64 oracle;
    with ``eager_factor``, also allow that many times the error of eager (`eager_widened`).

    With ``alternative``, each element of a gradient it returns may match either oracle
    (`either`); the tolerance stays the one of the first (the reference). A kernel with a kink
    (`KernelSpec.kink`: linear's relu) is always given that second oracle: its derivative on the side of
    the kink the backend's own forward output shows, where the rounding of the forward allows it."""
    report = CheckReport(spec.name)
    grad_names = [n for n in spec.differentiable if isinstance(args[n], torch.Tensor)]
    leaves = {k: (v.detach().requires_grad_(True) if k in grad_names else v) for k, v in args.items()}
    oracle = {k: to_oracle(v) for k, v in args.items()}
    oracle = {k: (v.requires_grad_(True) if k in grad_names else v) for k, v in oracle.items()}
    ref_outs = as_tuple(oracle_backend().call(spec.name, **oracle))
    grads = [torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.device)
             if o.is_floating_point() else None for o in ref_outs]
    before = snapshot(leaves)
    with poisoned():
        outs = as_tuple(backend.call(spec.name, **leaves))
        # the upstream gradients in each output's dtype, for the oracle too (as the inputs are): a
        # rounding the backend is given and the oracle is not would be the check's own error, and
        # one that cancellation amplifies (a one-element row's dx = w · dy · eps · rstd³ + dh)
        grads = [None if g is None else g.to(o.dtype).to(torch.float64) for o, g in zip(outs, grads)]
        pairs = [(o, g.to(o.dtype).to(o.device)) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], [leaves[n] for n in grad_names],
                                  [g for _, g in pairs], allow_unused=True)
    ref_pairs = [(o, g) for o, g in zip(ref_outs, grads) if g is not None and o.requires_grad]
    upstream = {f"d{n}": g for n, o, g in zip(spec.outputs, ref_outs, grads) if g is not None and o.requires_grad}
    expected = torch.autograd.grad([o for o, _ in ref_pairs], [oracle[n] for n in grad_names],
                                   [g for _, g in ref_pairs], allow_unused=True)
    report.problems += modified(leaves, before)
    expected = tuple(torch.zeros(leaves[n].shape, dtype=torch.float64, device=leaves[n].device) if e is None else e
                     for n, e in zip(grad_names, expected))
    # the outputs' own rows too: where an inf or NaN makes every input's gradient NaN (attention's
    # dv and dk after an inf score), the loss still has a finite scale
    response = max(loss_response({n: oracle[n] for n in grad_names}, dict(zip(grad_names, expected))),
                   loss_response({n: o for n, o, g in zip(spec.outputs, ref_outs, grads) if g is not None},
                                 {n: g for n, g in zip(spec.outputs, grads) if g is not None}))
    fallback_row = max((mean_row(oracle[n]) for n in grad_names), default=0.0)
    eagers = _eager_grads(spec, args, grad_names, grads) if eager_factor else expected
    rounding, kink = spec.rounding, spec.kink
    checked = spec.check((), oracle, oracle_backend().dtypes) if alternative or rounding or kink else {}
    alternatives = {} if kink is None else kink(checked, upstream, dict(zip(spec.outputs, outs)), dtype)
    alternatives.update({} if alternative is None else alternative(checked, upstream))
    allowances = {} if rounding is None else rounding(checked, upstream, dtype)
    for name, g, e, eager in zip(grad_names, got, expected, eagers):
        leaf = leaves[name]
        g = torch.zeros_like(leaf) if g is None else g
        if g.dtype != leaf.dtype:
            report.problems.append(f"grad of '{name}' has dtype {g.dtype}, expected {leaf.dtype}")
        tol = tolerance_for(backend, spec.name, dtype, g, tolerance_scale, {**args, **upstream}, f"d{name}")
        tol = eager_widened(gradient_floor(tol, response, oracle[name], e, dtype, fallback_row),
                            f"d{name}", eager, e, eager_factor)
        if name in alternatives:
            e = either(g, e, alternatives[name])
        report.comparisons.append(compare(f"d{name}", g, e, tol, allowances.get(name)))
    return report


def _eager_grads(spec: KernelSpec, args: Args, grad_names: Sequence[str],
                 grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The gradients of the reference run in the dtype under test, for the same upstream gradients."""
    leaves = _eager_inputs(args, grad_names)
    pairs = [(o, g.to(o.dtype)) for o, g in zip(as_tuple(oracle_backend().call(spec.name, **leaves)), grads)
             if g is not None and o.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], [leaves[n] for n in grad_names], [g for _, g in pairs],
                              allow_unused=True)
    return [torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(grad_names, got)]


def loss_response(inputs: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> float:
    """The largest first-order change of the loss ``L = Σ dy · y`` under a relative change of one
    row (the last dimension) of one input, ``max_x max_row Σ_row |x · dL/dx|`` (float64, over the
    finite terms): the scale of what the gradients are for. Given the outputs ``y`` and their
    upstream gradients ``dy``, the largest row of ``Σ |dy · y|``: the loss's own scale."""
    return max((float(_row_sums(finite(inputs[n].detach().to(torch.float64) * g)).max())
                for n, g in grads.items() if g.numel()), default=0.0)


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """Σ|t| over each row (the last dimension; a tensor of fewer than two dimensions is one row)."""
    return t.abs().reshape(-1, t.shape[-1] if t.dim() > 1 else max(t.numel(), 1)).sum(-1)


def mean_row(x: torch.Tensor) -> float:
    """The mean over the rows of ``x`` of Σ|x| (float64, finite terms; 0 for an empty tensor)."""
    return float(_row_sums(finite(x.detach().to(torch.float64))).mean()) if x.numel() else 0.0


def gradient_floor(tol: Tolerance, response: float, x: torch.Tensor, ref: torch.Tensor,
                   dtype: torch.dtype, fallback_row: float = 0.0) -> Tolerance:
    """``tol`` for the gradient ``ref`` of ``x``, with an absolute floor where the oracle is
    (nearly) all zeros (causal attention with a single key: dq = 0 exactly).

    The gradient's natural scale is ``S = response / (Σ|x| / rows)`` (`loss_response`): the
    gradient at which an average row of ``x`` would matter to the loss as much as the row of any
    input that matters most. Rows, not single elements: a gradient's error changes the loss
    through whole rows (causal attention with one key and 65 queries: the key's row of ``v``
    matters, and dq is the rounding of a cancellation in the one query that sees it). Where
    ``max|ref| ≤ u · S`` (u the unit roundoff of float32, in which every backend computes; of
    float64 when the ``dtype`` under test is float64) the result is below the rounding of the
    terms that cancel to it, and a bound relative to ``max|ref|`` would demand the oracle's exact
    cancellation: the floor is then ``atol · S``. Elsewhere ``tol`` is unchanged, so a small but
    resolvable gradient (attention scores ×1e-3 make dq small) is still held to its own scale.

    An ``x`` of zeros has no relative change to scale by: its rows are taken at ``fallback_row``,
    the mean row of the call's largest differentiable input (attention with one key and ``k`` all
    zeros: dk = 0 exactly, as the one key's weight is 1 whatever its score, and a kernel's dk is
    the rounding of ``Σ dp · p`` over one term)."""
    if ref.numel() == 0:
        return tol
    row = mean_row(x) or fallback_row
    if row == 0:
        return tol
    scale = response / row
    u = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
    if float(finite(ref.abs()).max()) > u * scale or tol.atol * scale <= tol.abs_floor:
        return tol
    return replace(tol, abs_floor=tol.atol * scale,
                   reason=f"{tol.reason}; oracle (nearly) all zeros: at least {tol.atol * scale:.3g}")
