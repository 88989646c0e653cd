"""RMS normalization: ``rms_norm`` and the fused residual form ``add_rms_norm``.

    rstd = rsqrt(mean(x², -1) + eps)        (statistics in float32 at least)
    y    = x · rstd · weight

Backward, with x̂ = x · rstd and g = dy · weight:
    dx      = rstd · (g − x̂ · mean(g · x̂, -1))
    dweight = Σ_rows dy · x̂
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..spec import (
    Args,
    BadInput,
    Case,
    Check,
    KernelSpec,
    compute_dtype,
    finite,
    identity,
    leading_dims,
    neighbors,
    randn,
    row_cases,
    rows,
    transposed,
)


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """Root-mean-square normalization over the last dimension.

    ``y = x * rsqrt(mean(x², -1) + eps) * weight``; statistics in float32 (float64 for float64).
    ``x``: ``[..., D]``; ``weight``: ``[D]``, ``x.dtype`` or float32, or None. Returns ``y`` like x.
    Differentiable with respect to ``x`` and ``weight``.
    """
    raise AssertionError("signature only: call backend.rms_norm")


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Residual add fused with RMS normalization.

    ``h = x + residual`` (rounded to ``x.dtype``), ``y = rms_norm(h, weight, eps)``.
    Returns ``(y, h)``. Differentiable with respect to ``x``, ``residual`` and ``weight``.
    """
    raise AssertionError("signature only: call backend.add_rms_norm")


def _check_norm_input(c: Check, x: Any, weight: Any, eps: Any) -> None:
    c.tensor("x", x, min_ndim=1)
    c.param("weight", weight, x, (x.shape[-1],))
    c.number("eps", eps, low=0.0)


def validate_rms_norm(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    _check_norm_input(Check("rms_norm", dtypes), a["x"], a["weight"], a["eps"])
    return a


def validate_add_rms_norm(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("add_rms_norm", dtypes)
    _check_norm_input(c, a["x"], a["weight"], a["eps"])
    c.tensor("residual", a["residual"])
    c.same_dtype("residual", a["residual"], a["x"], "x")
    c.shape("residual", a["residual"], a["x"].shape)
    c.same_device("residual", a["residual"], a["x"])
    return a


def _normalize(h: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    ct = compute_dtype(h.dtype)
    hr = rows(h).to(ct)
    # an empty row (D = 0) keeps a finite rstd: its mean square is taken as 0
    rstd = torch.rsqrt(hr.square().sum(-1) / max(hr.shape[-1], 1) + eps)
    y = hr * rstd[:, None]
    if weight is not None:
        y = y * weight.to(ct)
    # contiguous even for a transposed input: elementwise ops keep the input's layout
    return y.to(h.dtype).reshape(h.shape).contiguous(), rstd


def _normalize_backward(
    h: Tensor, weight: Optional[Tensor], rstd: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor]:
    ct = rstd.dtype
    xhat = rows(h).to(ct) * rstd[:, None]
    dyr = rows(dy).to(ct)
    g = dyr * weight.to(ct) if weight is not None else dyr
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dweight = (dyr * xhat).sum(0).to(weight.dtype) if weight is not None else h.new_empty(0)
    return dx, dweight


def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """Returns ``(y, rstd)``; ``rstd`` is ``[rows]`` in float32 (float64 for float64 input)."""
    return _normalize(x, weight, eps)


def rms_norm_bwd(
    x: Tensor, weight: Optional[Tensor], eps: float, y: Tensor, rstd: Tensor, dy: Optional[Tensor]
) -> tuple[Tensor, Tensor]:
    """Returns ``(dx, dweight)``; ``dweight`` is empty when ``weight`` is None."""
    dx, dweight = _normalize_backward(x, weight, rstd, dy if dy is not None else torch.zeros_like(y))
    return dx.to(x.dtype).reshape(x.shape).contiguous(), dweight


def add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(y, h, rstd)``."""
    # contiguous even for transposed inputs (an output of the contract is a new contiguous tensor)
    h = (x.to(compute_dtype(x.dtype)) + residual.to(compute_dtype(x.dtype))).to(x.dtype).contiguous()
    y, rstd = _normalize(h, weight, eps)
    return y, h, rstd


def add_rms_norm_bwd(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
    y: Tensor, h: Tensor, rstd: Tensor, dy: Optional[Tensor], dh: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Returns ``(dh_total, dweight)``: the gradient of ``h`` (both ``x`` and ``residual``
    receive it) including the gradient flowing into the ``h`` output, and ``dweight``."""
    dx, dweight = _normalize_backward(h, weight, rstd, dy if dy is not None else torch.zeros_like(h))
    if dh is not None:
        dx = dx + rows(dh).to(dx.dtype)
    return dx.to(x.dtype).reshape(x.shape).contiguous(), dweight


def _rms_norm_flops(a: Args) -> float:
    return 4.0 * a["x"].numel()


def _add_rms_norm_flops(a: Args) -> float:
    return 5.0 * a["x"].numel()


def _make(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
          layout=identity, residual: bool = False, weight_dtype: torch.dtype | None = None,
          eps: float = 1e-6) -> Args:
    x = layout(randn(g, *shape, dtype=dtype, scale=scale))
    weight = randn(g, shape[-1], dtype=weight_dtype or dtype) + 1.0
    if residual:
        return {"x": x, "residual": layout(randn(g, *shape, dtype=dtype, scale=scale)), "weight": weight, "eps": eps}
    return {"x": x, "weight": weight, "eps": eps}


def _cases(residual: bool):
    def cases():
        def make(g, dtype, **kw):
            if kw["shape"][-1] == 1:
                # a one-element row's dx, eps · rstd³ · dy · w, is the difference of two numbers equal
                # to within eps / x²: at eps = 1e-6 float32 cannot form it (the reference backend's
                # own float32 result is 0.7% off), at eps = 1 it is well conditioned
                kw.setdefault("eps", 1.0)
            return _make(g, dtype, residual=residual, **kw)

        def case(name: str, description: str, **kw) -> Case:
            return Case(name, lambda g, dtype: make(g, dtype, **kw), description=description)

        # the normalized h is x (mean square scale²) or x + residual (2·scale²)
        small = 7e-4 if residual else 1e-3
        extra = [
            # eps as large as the mean square, and a large eps at unit scale: an eps misplaced
            # (outside the root, added to the rms, dropped from the backward) gives a wrong result
            case("eps_comparable", f"inputs scaled by {small:g}: eps = 1e-6 about their mean square",
                 shape=(8, 256), scale=small),
            case("eps_large", "eps = 1 at unit-scale inputs", shape=(8, 256), eps=1.0),
            # a dense column-major layout: elementwise results follow it unless made contiguous
            case("transposed", "transposed inputs (dense, column-major)", shape=(256, 96), layout=transposed),
            # mixed precision training: float32 weight with 16-bit activations
            Case("fp32_weight", lambda g, dtype: _make(g, dtype, shape=(5, 256), residual=residual,
                                                      weight_dtype=torch.float32),
                 dtypes=(torch.float16, torch.bfloat16)),
            Case("no_weight", lambda g, dtype: {**_make(g, dtype, shape=(5, 256), residual=residual),
                                                 "weight": None}),
        ]
        return row_cases(make, (16384, 4096)) + extra
    return cases


def _bad_inputs(kernel: str):
    def bad():
        base = dict(x=torch.randn(4, 8), weight=torch.ones(8), eps=1e-6)
        if kernel == "add_rms_norm":
            base["residual"] = torch.randn(4, 8)
        cases = [
            BadInput("int_x", lambda: {**base, "x": torch.ones(4, 8, dtype=torch.int64)}),
            BadInput("scalar_x", lambda: {**base, "x": torch.tensor(1.0)}),
            BadInput("weight_shape", lambda: {**base, "weight": torch.ones(7)}),
            BadInput("weight_dtype", lambda: {**base, "weight": torch.ones(8, dtype=torch.float16)}),
            BadInput("weight_device", lambda: {**base, "weight": torch.ones(8, device="meta")}),
            BadInput("negative_eps", lambda: {**base, "eps": -1.0}),
            BadInput("not_a_tensor", lambda: {**base, "x": [[1.0, 2.0]]}),
        ]
        if kernel == "add_rms_norm":
            cases += [
                BadInput("residual_shape", lambda: {**base, "residual": torch.randn(4, 9)}),
                BadInput("residual_dtype", lambda: {**base, "residual": torch.randn(4, 8, dtype=torch.float64)}),
            ]
        return cases
    return bad


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
    x, residual = (finite(args[n].detach().to(torch.float64)) for n in ("x", "residual"))
    weight, eps = args["weight"], args["eps"]
    weight = None if weight is None else finite(weight.detach().to(torch.float64))
    dy = finite(upstream["dy"].detach().to(torch.float64))
    exact = x + residual

    def grads(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, rstd = rms_norm_fwd(h, weight, eps)
        return rms_norm_bwd(h, weight, eps, y, rstd, dy)

    dx, dw = grads(exact)
    (dx_below, dw_below), (dx_above, dw_above) = (grads(h) for h in neighbors(exact, dtype))
    moved = torch.maximum((dx_below - dx).abs(), (dx_above - dx).abs())
    allowance = {"x": moved, "residual": moved}
    return allowance if weight is None else {
        **allowance, "weight": torch.maximum((dw_below - dw).abs(), (dw_above - dw).abs())}


RMS_NORM = KernelSpec(
    name="rms_norm",
    signature=rms_norm,
    validate=validate_rms_norm,
    forward=rms_norm_fwd,
    backward=rms_norm_bwd,
    outputs=("y",),
    saved=("rstd",),
    differentiable=("x", "weight"),
    flops=_rms_norm_flops,
    cases=_cases(residual=False),
    bad_inputs=_bad_inputs("rms_norm"),
    sharding=leading_dims(("y",), ("x",), ("rstd",)),
    memory_bound=True,
    peers=("liger", "flag_gems"),
)

ADD_RMS_NORM = KernelSpec(
    name="add_rms_norm",
    signature=add_rms_norm,
    validate=validate_add_rms_norm,
    forward=add_rms_norm_fwd,
    backward=add_rms_norm_bwd,
    outputs=("y", "h"),
    saved=("rstd",),
    differentiable=("x", "residual", "weight"),
    grads=lambda r: (r[0], r[0], r[1]),
    flops=_add_rms_norm_flops,
    cases=_cases(residual=True),
    bad_inputs=_bad_inputs("add_rms_norm"),
    sharding=leading_dims(("y", "h"), ("x", "residual"), ("rstd",)),
    memory_bound=True,
    rounding=add_rms_norm_rounded_h,
    peers=("liger",),
)

SPECS = (RMS_NORM, ADD_RMS_NORM)
