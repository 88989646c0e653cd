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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .backend import Backend
from .kernels.attention import by_chunks, probabilities, visible_keys
from .kernels.cross_entropy import dlogits, row_grads
from .kernels.linear import activation_grad as linear_activation_grad
from .kernels.linear import linear_backward
from .kernels.rms_norm import rms_norm_backward, rms_norm_forward
from .ops import as_tuple
from .spec import Args, KernelSpec, rows
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
    `ROUNDING_ALLOWANCES`) are not counted."""
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
        err = (err - _finite(allowance.to(err.device, torch.float64))).clamp_min(0.0)
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
    if ref.numel() and float(_finite(ref.detach().to(torch.float64)).abs().max()) == 0:
        # an oracle of exact zeros (a cancellation: smoothed cross-entropy of equal logits) scales no
        # bound relative to it: eager's largest error, times factor, is allowed as a floor instead
        err = _finite(eager.detach().to(torch.float64) - ref.detach().to(eager.device, torch.float64)).abs().max()
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


AlternativeGradients = Callable[[Args, Args], dict[str, torch.Tensor]]
"""A second oracle of a kernel's gradients, for calls where the contract allows two results (as
attention's for a non-finite value in pairs its causal mask hides): called with the checked
float64 arguments of the oracle and the upstream gradients (named as for `tolerance_for`: ``do``
for the output ``o``), it returns float64 gradients by input name."""


def check_backward(backend: Backend, spec: KernelSpec, args: Args, dtype: torch.dtype,
                   generator: torch.Generator, tolerance_scale: float = 1.0, eager_factor: float = 0.0,
                   alternative: AlternativeGradients | None = None) -> CheckReport:
    """Gradients through ``backend`` for random output gradients (in each output's dtype, the
    oracle's as well), against the float64 oracle;
    with ``eager_factor``, also allow that many times the error of eager (`eager_widened`).

    With ``alternative``, each element of a gradient it returns may match either oracle
    (`either`); the tolerance stays the one of the first (the reference). A kernel with a kink
    (`KINKS`: linear's relu) is always given that second oracle: its derivative on the side of
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
    eagers = _eager_grads(spec, args, grad_names, grads) if eager_factor else expected
    rounding, kink = ROUNDING_ALLOWANCES.get(spec.name), KINKS.get(spec.name)
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
        tol = eager_widened(gradient_floor(tol, response, oracle[name], e, dtype), f"d{name}", eager, e, eager_factor)
        if name in alternatives:
            e = either(g, e, alternatives[name])
        report.comparisons.append(compare(f"d{name}", g, e, tol, allowances.get(name)))
    return report


def attention_hidden_pairs_add_nothing(args: Args, upstream: Args) -> dict[str, torch.Tensor]:
    """Attention's gradients (float64) as if the pairs that the causal mask hides were never
    computed: the contract's alternative to the reference's dense products for an inf or NaN met
    only in hidden pairs (`kpt.kernels`, "Special values"), an `AlternativeGradients`.

    The reference (`kpt.kernels.attention`) multiplies every (query, key) pair, so an inf or NaN of
    a hidden key, value or score row reaches other pairs' gradients as ``0 · inf = NaN``; a tiled
    kernel that skips hidden tiles does not. Here nothing of a hidden pair is ever multiplied into
    a sum: p, dp and ds are exactly 0 there (``torch.where``, not a product with 0), and the sums
    over pairs (``ds · k``, ``dsᵀ · q``, ``pᵀ · dO``, ``rowsum(p ⊙ dp)``) add elementwise products
    selected with the mask. Grouped-query heads add into their key/value head as in the reference.
    A query whose visible scores hold NaN or +inf has NaN gradients here too.

    ``args``: the checked arguments of the oracle (q, k, v, ``causal``, ``scale``); ``upstream``:
    ``{"do": dO}``. Its ``[.., Sq, Skv, D]`` products make it for small shapes only (the fuzzing's).
    """
    q, k, v, do = (t.detach().to(torch.float64) for t in (args["q"], args["k"], args["v"], upstream["do"]))
    batch, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    grouped = (batch, hkv, hq // hkv, sq, d)  # query heads by their key/value head
    qg, dog, kg, vg = q.reshape(grouped), do.reshape(grouped), k[:, :, None], v[:, :, None]
    visible = visible_keys(sq, skv, args["causal"], q.device)
    if args.get("mask") is not None:
        visible = visible & args["mask"].reshape(grouped[:-1] + (skv,))
    # q·kᵀ and dO·vᵀ hold one product per pair: a hidden pair's is selected away before any sum
    s = torch.where(visible, (qg @ kg.mT) * args["scale"], -math.inf)
    p = torch.where(visible, probabilities(s), 0.0)
    dp = torch.where(visible, dog @ vg.mT, 0.0)
    delta = torch.where(visible, p * dp, 0.0).sum(-1, keepdim=True)
    ds = torch.where(visible, p * (dp - delta), 0.0)

    def pair_sum(weights: torch.Tensor, rows: torch.Tensor, over: int) -> torch.Tensor:
        # Σ over keys (over=-2: rows of k) or queries (over=-3: rows of q, dO) of weights[i, j] · rows
        rows = rows[..., None, :, :] if over == -2 else rows[..., :, None, :]
        return torch.where(visible[..., None], weights[..., None] * rows, 0.0).sum(over)

    dq = pair_sum(ds, kg, -2) * args["scale"]
    dk = pair_sum(ds, qg, -3).sum(2) * args["scale"]
    dv = pair_sum(p, dog, -3).sum(2)
    return {"q": dq.reshape(q.shape), "k": dk, "v": dv}


def attention_rounded_o(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Attention's `RoundingAllowance`: what FlashAttention's ``rowsum(dO ⊙ o)``, taken from ``o``
    in the inputs' ``dtype``, typically moves dq and dk by (`kpt.tolerance`).

    ``o`` carries the rounding of p before ``p · v`` and its own, up to ``u · (|o| + p · |v|)`` per
    element (u the unit roundoff of ``dtype``); rounding errors of independent signs add in
    quadrature, so query i's row sum errs by about ``ε_i = u · ‖dO_i ⊙ (|o_i| + (p·|v|)_i)‖₂``.
    Every ``ds_ij = p_ij (dp_ij − rowsum_i)`` then moves by ``−p_ij ε_i``: dq_i by
    ``scale · ε_i · (p·k)_i`` (one direction), dk_j by ``scale · Σ_i p_ij ε_i q_i`` (in quadrature
    over i). Where dp_ij and the row sum nearly cancel (two keys of very unequal probability) that
    is far above the tolerance's share of the gradient; elsewhere it is a small part of it. Float64
    from the oracle's arguments (the checked q, k, v, ``causal``, ``scale``) and ``{"do": dO}``."""
    u, scale = torch.finfo(dtype).eps / 2, args["scale"]

    def rounded(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, hq, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        grouped = (batch, hkv, hq // hkv, sq, d)
        v = rest[-1]
        qg, dog, kg, vg = (_finite(t) for t in (q.reshape(grouped), do.reshape(grouped), k[:, :, None], v[:, :, None]))
        visible = visible_keys(sq, skv, args["causal"], q.device)
        if len(rest) == 2:  # the mask, sliced with q
            visible = visible & rest[0].reshape(batch, hkv, hq // hkv, sq, skv)
        s = torch.where(visible, (qg @ kg.mT) * scale, -math.inf)
        p = _finite(probabilities(s))
        eps = u * torch.linalg.vector_norm(dog * ((p @ vg).abs() + p @ vg.abs()), dim=-1, keepdim=True)
        dq = scale * eps * (p @ kg).abs()
        dk = scale * ((p * eps).square().mT @ qg.square()).sum(2).sqrt()
        return dq.reshape(q.shape), dk

    # by batch entries and key/value heads, as the reference's attention: [.., Sq, Skv] scores in float64
    q, k, v, do = (t.detach().to(torch.float64) for t in (args["q"], args["k"], args["v"], upstream["do"]))
    mask = () if args.get("mask") is None else (args["mask"],)
    dq, dk = by_chunks(rounded, q, k, do, *mask, per_key=(v,))
    return {"q": dq, "k": dk}


def _rounded_operand(d: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What rounding ``d`` ``[M, N]`` to ``dtype`` before the products ``d · w`` (``w``: ``[N, K]``)
    and ``dᵀ · x`` (``x``: ``[M, K]``) and the column sums ``Σ_i d_ij`` moves those three by.

    Each element of ``d`` carries up to ``u · |d|`` (u the unit roundoff of ``dtype``), a rounding
    of standard deviation at most ``u · |d| / √3``; a sum of such terms moves by at most the sum of
    their bounds and, their signs independent, by three standard deviations of the sum at most
    ``√3 · u · ‖terms‖₂``: the smaller of the two. Far beyond a bound relative to the result where
    its terms nearly cancel (the column sum of a few rows), a small part of it elsewhere."""
    e = torch.finfo(dtype).eps / 2 * d.abs()

    def summed(bounds: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        # a sum of roundings: the sum of their bounds, or three deviations if that is less
        return torch.minimum(bounds, math.sqrt(3) * squares.sqrt())

    return (summed(e @ w.abs(), e.square() @ w.square()), summed(e.T @ x.abs(), e.square().T @ x.square()),
            summed(e.sum(0), e.square().sum(0)))


def linear_rounded_dpre(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Linear's `RoundingAllowance`: what rounding ``dpre = dy ⊙ act'(pre)`` to the inputs'
    ``dtype`` (the operand of the products ``dx = dpre · weight`` and ``dweight = dpreᵀ · x`` in
    that dtype, and of dbias's sum) moves the gradients by (`kpt.tolerance`), bounded as
    `_rounded_operand` does.

    Float64 from the oracle's checked arguments (x, weight, bias, activation) and ``{"dy": dy}``."""
    x, w = (_finite(t.detach().to(torch.float64)) for t in (rows(args["x"]), args["weight"]))
    dy = _finite(rows(upstream["dy"]).detach().to(torch.float64))
    bias, activation = args["bias"], args["activation"]
    pre = x @ w.T + (0.0 if bias is None else _finite(bias.detach().to(torch.float64)))
    dpre = dy if activation is None else _finite(dy * linear_activation_grad(activation)(pre))
    dx, dw, db = _rounded_operand(dpre, x, w, dtype)
    allowance = {"x": dx.reshape(args["x"].shape), "weight": dw}
    return allowance if bias is None else {**allowance, "bias": db}


def linear_cross_entropy_rounded_dz(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """linear_cross_entropy's `RoundingAllowance`: what rounding the logits' gradient
    ``dz = g · (softmax(z) − onehot)`` to the inputs' ``dtype`` (the operand of the products
    ``dhidden = dz · weight`` and ``dweight = dzᵀ · hidden`` in that dtype, and of dbias's sum, as
    linear's ``dpre``) moves the gradients by, bounded as `_rounded_operand` does.

    Float64 from the oracle's checked arguments (hidden, weight, target, bias, ignore_index,
    reduction) and ``{"dloss": dloss}``."""
    h, w = (_finite(args[n].detach().to(torch.float64)) for n in ("hidden", "weight"))
    bias, target, ignore_index = args["bias"], args["target"].to(h.device), args["ignore_index"]
    z = h @ w.T + (0.0 if bias is None else _finite(bias.detach().to(torch.float64)))
    kept = target != ignore_index
    row_grad = _finite(row_grads(upstream["dloss"].detach().to(h.device), target, ignore_index, args["reduction"],
                                 torch.float64))
    dz = _finite(dlogits(z, target, torch.logsumexp(z, -1), 0.0, row_grad, kept))
    dh, dw, db = _rounded_operand(dz, torch.where(kept[:, None], h, 0.0), w, dtype)
    allowance = {"hidden": dh, "weight": dw}
    return allowance if bias is None else {**allowance, "bias": db}


def linear_relu_kernel_side(args: Args, upstream: Args, outputs: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Linear's second oracle for relu (`KINKS`): the gradients with relu' taken on the side of 0
    that the backend's own forward shows (``y > 0``) wherever the oracle's pre-activation lies
    within the forward's rounding of 0, the oracle's relu' elsewhere (float64).

    relu' jumps from 0 to 1 at 0, so a pre-activation that the forward's rounding can move across
    0 may take either derivative — but the backward must take the one its forward took. That
    rounding is ``K · u_acc · Σ_k |x_ik · weight_jk|`` for float32 accumulation (u_acc of float64
    for float64), plus ``u · Σ_k |x_ik · weight_jk|`` for 16-bit inputs (u of ``dtype``), whose
    products may round the partial sums of a split reduction to the inputs' dtype (cuBLAS under
    torch's default ``allow_bf16_reduced_precision_reduction``), and below float32's smallest
    normal (flushed) or the dtype's smallest subnormal (rounded to 0) any value may land on 0.
    ``args``: the oracle's checked x, weight, bias, activation; ``upstream``: ``{"dy": dy}``;
    ``outputs``: the backend's ``{"y": y}``. Empty for every other activation."""
    if args["activation"] != "relu":
        return {}
    x, w, dy = (t.detach().to(torch.float64) for t in (rows(args["x"]), args["weight"], rows(upstream["dy"])))
    bias = args["bias"]
    pre = x @ w.T + (0.0 if bias is None else bias.detach().to(torch.float64))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    u = torch.finfo(acc).eps / 2 * x.shape[-1] + (torch.finfo(dtype).eps / 2 if dtype.itemsize == 2 else 0.0)
    zero = max(torch.finfo(acc).tiny, torch.finfo(dtype).tiny * torch.finfo(dtype).eps)
    near = pre.abs() <= u * (_finite(x).abs() @ _finite(w).abs().T) + zero
    kernel_side = rows(outputs["y"]).detach().to(pre.device, torch.float64) > 0
    dpre = dy * torch.where(near, kernel_side, ~(pre <= 0))  # relu'(NaN) = 1, as the reference's
    # the reference's backward from that dpre (no activation left to apply)
    dx, dweight, dbias = linear_backward(args["x"].detach().to(torch.float64), w,
                                         None if bias is None else bias.detach().to(torch.float64),
                                         None, pre, pre, dpre)
    grads = {"x": dx, "weight": dweight}
    return grads if bias is None else {**grads, "bias": dbias}


def add_rms_norm_rounded_h(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """add_rms_norm's `RoundingAllowance`: what rounding ``h = x + residual`` to the inputs'
    ``dtype`` before normalizing it (the contract's ``h``, which the oracle holds exactly) moves the
    gradients by, elementwise: the larger change of the reference's float64 gradients when ``h`` is
    either of the two ``dtype`` values around the exact sum (GPUs round to nearest; Triton's
    interpreter truncates).

    ``dx`` (= ``dresidual``) is ``w · dy · rstd`` less a correction, plus the gradient of the ``h``
    output; where those terms nearly cancel (a row of one element, whose ``dx`` is
    ``eps · rstd³ · w · dy + dh``), the rounding of ``h`` moves it far beyond a bound relative to the
    result (3% of a bfloat16 ``dx``); elsewhere it is a small part of the tolerance."""
    x, residual = (_finite(args[n].detach().to(torch.float64)) for n in ("x", "residual"))
    weight, eps = args["weight"], args["eps"]
    weight = None if weight is None else _finite(weight.detach().to(torch.float64))
    dy = _finite(upstream["dy"].detach().to(torch.float64))
    exact = x + residual

    def grads(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, rstd = rms_norm_forward(h, weight, eps)
        return rms_norm_backward(h, weight, eps, y, rstd, dy)

    dx, dw = grads(exact)
    (dx_below, dw_below), (dx_above, dw_above) = (grads(h) for h in _neighbors(exact, dtype))
    moved = torch.maximum((dx_below - dx).abs(), (dx_above - dx).abs())
    allowance = {"x": moved, "residual": moved}
    return allowance if weight is None else {
        **allowance, "weight": torch.maximum((dw_below - dw).abs(), (dw_above - dw).abs())}


def softmax_rounded_y(args: Args, upstream: Args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """softmax's `RoundingAllowance`: what taking ``dx = y · (dy − Σ_dim dy · y)`` from the saved
    output ``y`` in the inputs' ``dtype`` (either neighbour of the exact probability: GPUs round to
    nearest, Triton's interpreter truncates), which the oracle holds exact, moves dx by.

    With ``|ŷ_j − y_j| ≤ δ_j``, the step of ``dtype`` at ``y_j``, ``dx_i`` moves by at most
    ``δ_i · |dy_i − Σ_j y_j dy_j| + (y_i + δ_i) · Σ_j δ_j |dy_j|``. The rounded probabilities of a
    short row need not sum to 1: where ``dy_i`` nearly equals the row's ``Σ_j y_j dy_j`` (two
    probabilities far apart) that is far above the tolerance's share of dx; elsewhere it is about
    one step of ``dtype`` relative to dx."""
    dim = args["dim"]
    y = _finite(torch.softmax(args["x"].detach().to(torch.float64), dim))
    dy = _finite(upstream["dy"].detach().to(torch.float64).to(y.device))
    below, above = _neighbors(y, dtype)
    step = above - below
    dot = (y * dy).sum(dim, keepdim=True)
    return {"x": step * (dy - dot).abs() + (y + step) * (step * dy.abs()).sum(dim, keepdim=True)}


def _neighbors(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``dtype`` values just below and just above each element of the float64 ``t`` (both
    ``t`` where ``dtype`` holds it; ``dtype``'s exponent range is not bounded here)."""
    if dtype == torch.float64:
        return t, t
    info = torch.finfo(dtype)
    # t = m · 2^e with 0.5 <= |m| < 1: the step of dtype in t's binade, its subnormal step below
    step = (torch.ldexp(torch.ones_like(t), torch.frexp(t).exponent - 1) * info.eps).clamp_min(info.tiny * info.eps)
    below = torch.floor(t / step) * step
    return below, torch.where(below == t, t, below + step)


RoundingAllowance = Callable[[Args, Args, torch.dtype], dict[str, torch.Tensor]]
"""Per-element absolute error a kernel's gradients may carry beyond the tolerance, from a rounding
that the contract permits and a bound relative to the result cannot hold (it is amplified where
terms cancel): called with the checked float64 arguments of the oracle, the upstream gradients
and the dtype under test, it returns float64 allowances by input name."""

ROUNDING_ALLOWANCES: dict[str, RoundingAllowance] = {
    "attention": attention_rounded_o, "linear": linear_rounded_dpre, "add_rms_norm": add_rms_norm_rounded_h,
    "softmax": softmax_rounded_y, "linear_cross_entropy": linear_cross_entropy_rounded_dz}
"""The kernels whose gradients `check_backward` allows a contract-permitted rounding, and its bound:
attention's row sums from a rounded ``o``, linear's rounded ``dpre``, add_rms_norm's rounded ``h``,
softmax's rounded ``y``, linear_cross_entropy's rounded ``dz``."""

KINKS: dict[str, Callable[[Args, Args, Args, torch.dtype], dict[str, torch.Tensor]]] = {
    "linear": linear_relu_kernel_side}
"""The kernels whose derivative jumps somewhere (relu's at 0), and their second oracle: the side
the backend's forward took, where its rounding allows either; `check_backward` always uses it.
Called with the oracle's checked arguments, the upstream gradients, the backend's forward outputs
(by name) and the dtype under test."""

ALTERNATIVE_GRADIENTS: dict[str, AlternativeGradients] = {"attention": attention_hidden_pairs_add_nothing}
"""The kernels whose gradients with special values the contract allows two ways, and the second
oracle of each (`check_backward`'s ``alternative``): attention's causal mask."""


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
    return max((float(_row_sums(_finite(inputs[n].detach().to(torch.float64) * g)).max())
                for n, g in grads.items() if g.numel()), default=0.0)


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """Σ|t| over each row (the last dimension; a tensor of fewer than two dimensions is one row)."""
    return t.abs().reshape(-1, t.shape[-1] if t.dim() > 1 else max(t.numel(), 1)).sum(-1)


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its infinities and NaNs (special input values and what they reach) as 0."""
    return torch.where(torch.isfinite(t), t, 0.0)


def gradient_floor(tol: Tolerance, response: float, x: torch.Tensor, ref: torch.Tensor,
                   dtype: torch.dtype) -> Tolerance:
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
    resolvable gradient (attention scores ×1e-3 make dq small) is still held to its own scale."""
    if ref.numel() == 0:
        return tol
    rows = _row_sums(_finite(x.detach().to(torch.float64)))
    mean_row = float(rows.mean())
    if mean_row == 0:
        return tol
    scale = response / mean_row
    u = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
    if float(_finite(ref.abs()).max()) > u * scale or tol.atol * scale <= tol.abs_floor:
        return tol
    return replace(tol, abs_floor=tol.atol * scale,
                   reason=f"{tol.reason}; oracle (nearly) all zeros: at least {tol.atol * scale:.3g}")
