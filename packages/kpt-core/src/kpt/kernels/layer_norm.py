"""Layer normalization over the last dimension: ``layer_norm``.

    mean = mean(x, -1)
    rstd = rsqrt(mean((x − mean)², -1) + eps)      (biased variance; statistics in float32 at least)
    x̂    = (x − mean) · rstd
    y    = x̂ · weight + bias

Backward, with g = dy · weight:
    dx      = rstd · (g − mean(g, -1) − x̂ · mean(g · x̂, -1))
    dweight = Σ_rows dy · x̂
    dbias   = Σ_rows dy
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec import (
    Args,
    BadInput,
    Case,
    Check,
    KernelSpec,
    compute_dtype,
    identity,
    leading_dims,
    randn,
    row_cases,
    rows,
    transposed,
)


def layer_norm(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """Layer normalization over the last dimension, like ``F.layer_norm(x, (D,), weight, bias, eps)``.

    ``y = (x − mean(x, -1)) * rsqrt(var(x, -1) + eps) * weight + bias`` with the biased variance;
    statistics in float32 (float64 for float64). ``x``: ``[..., D]``; ``weight`` and ``bias``:
    ``[D]``, each ``x.dtype`` or float32, or None. Returns ``y`` like x.
    Differentiable with respect to ``x``, ``weight`` and ``bias``.
    """
    raise AssertionError("signature only: call backend.layer_norm")


def validate_layer_norm(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("layer_norm", dtypes)
    x = c.tensor("x", a["x"], min_ndim=1)
    c.param("weight", a["weight"], x, (x.shape[-1],))
    c.param("bias", a["bias"], x, (x.shape[-1],))
    c.number("eps", a["eps"], low=0.0)
    return a


def _row_mean(t: Tensor) -> Tensor:
    # an empty row has mean 0 rather than 0/0, so that its statistics stay finite
    return t.sum(-1) / max(t.shape[-1], 1)


def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(y, mean, rstd)``; ``mean`` and ``rstd`` are ``[rows]`` in float32 (float64 for
    float64 input)."""
    ct = compute_dtype(x.dtype)
    xr = rows(x).to(ct)
    mean = _row_mean(xr)
    # two passes (centre, then square): E[x²] − E[x]² cancels catastrophically when |mean| ≫ std
    centred = xr - mean[:, None]
    rstd = torch.rsqrt(_row_mean(centred.square()) + eps)
    y = centred * rstd[:, None]
    if weight is not None:
        y = y * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    # contiguous even for a transposed input: elementwise ops keep the input's layout
    return y.to(x.dtype).reshape(x.shape).contiguous(), mean, rstd


def layer_norm_bwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
    y: Tensor, mean: Tensor, rstd: Tensor, dy: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dx, dweight, dbias)``; ``dweight`` / ``dbias`` are empty when that parameter is None."""
    ct = rstd.dtype
    xhat = (rows(x).to(ct) - mean[:, None]) * rstd[:, None]
    dyr = rows(dy if dy is not None else torch.zeros_like(y)).to(ct)
    g = dyr * weight.to(ct) if weight is not None else dyr
    dx = rstd[:, None] * (g - _row_mean(g)[:, None] - xhat * _row_mean(g * xhat)[:, None])
    dweight = (dyr * xhat).sum(0).to(weight.dtype) if weight is not None else x.new_empty(0)
    dbias = dyr.sum(0).to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx.to(x.dtype).reshape(x.shape).contiguous(), dweight, dbias


def _flops(a: Args) -> float:
    # mean, centre, square, sum, scale by rstd; then one each for the weight and the bias
    return (5.0 + (a["weight"] is not None) + (a["bias"] is not None)) * a["x"].numel()


def _make(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
          layout=identity, offset: float = 0.0, param_dtype: torch.dtype | None = None,
          weight: bool = True, bias: bool = True, eps: float = 1e-5) -> Args:
    x = layout((randn(g, *shape, dtype=torch.float64, scale=scale) + offset).to(dtype))
    pd = param_dtype or dtype
    return {
        "x": x,
        "weight": randn(g, shape[-1], dtype=pd) + 1.0 if weight else None,
        "bias": randn(g, shape[-1], dtype=pd) if bias else None,
        "eps": eps,
    }


def _cases() -> list[Case]:
    def case(name: str, dtypes: tuple[torch.dtype, ...] | None = None, description: str = "", **kw) -> Case:
        return Case(name, lambda g, dtype: _make(g, dtype, **kw), dtypes=dtypes, description=description)

    return row_cases(_make, (16384, 4096)) + [
        # mixed precision training: float32 parameters with 16-bit activations
        case("fp32_params", shape=(5, 256), param_dtype=torch.float32,
             dtypes=(torch.float16, torch.bfloat16)),
        case("no_params", shape=(5, 256), weight=False, bias=False),
        case("weight_only", shape=(5, 256), bias=False),
        case("bias_only", shape=(5, 256), weight=False),
        # |mean| ≫ std: exposes a one-pass variance
        case("large_mean", shape=(8, 2048), offset=100.0),
        # eps as large as the variance, and a large eps at unit scale: an eps misplaced (outside
        # the root, added to the standard deviation, dropped from the backward) gives a wrong result
        case("eps_comparable", shape=(8, 256), scale=3e-3,
             description="inputs scaled by 3e-3: eps = 1e-5 about their variance"),
        case("eps_large", shape=(8, 256), eps=1.0, description="eps = 1 at unit-scale inputs"),
        # a dense column-major layout: elementwise results follow it unless made contiguous
        case("transposed", shape=(256, 96), layout=transposed, description="transposed input (dense, column-major)"),
    ]


def _bad_inputs() -> list[BadInput]:
    base = {"x": torch.randn(4, 8), "weight": torch.ones(8), "bias": torch.zeros(8), "eps": 1e-5}
    return [
        BadInput("int_x", lambda: {**base, "x": torch.ones(4, 8, dtype=torch.int64)}),
        BadInput("scalar_x", lambda: {**base, "x": torch.tensor(1.0)}),
        BadInput("not_a_tensor", lambda: {**base, "x": [[1.0, 2.0]]}),
        BadInput("weight_shape", lambda: {**base, "weight": torch.ones(7)}),
        BadInput("weight_dtype", lambda: {**base, "weight": torch.ones(8, dtype=torch.float16)}),
        BadInput("weight_device", lambda: {**base, "weight": torch.ones(8, device="meta")}),
        BadInput("bias_shape", lambda: {**base, "bias": torch.zeros(4, 8)}),
        BadInput("bias_dtype", lambda: {**base, "bias": torch.zeros(8, dtype=torch.int32)}),
        BadInput("bias_device", lambda: {**base, "bias": torch.zeros(8, device="meta")}),
        BadInput("negative_eps", lambda: {**base, "eps": -1e-5}),
        BadInput("eps_not_a_number", lambda: {**base, "eps": "1e-5"}),
    ]


LAYER_NORM = KernelSpec(
    name="layer_norm",
    signature=layer_norm,
    validate=validate_layer_norm,
    forward=layer_norm_fwd,
    backward=layer_norm_bwd,
    outputs=("y",),
    saved=("mean", "rstd"),
    differentiable=("x", "weight", "bias"),
    flops=_flops,
    cases=_cases,
    bad_inputs=_bad_inputs,
    sharding=leading_dims(("y",), ("x",), ("mean", "rstd")),
    memory_bound=True,
    peers=("liger",),
)

SPECS = (LAYER_NORM,)
