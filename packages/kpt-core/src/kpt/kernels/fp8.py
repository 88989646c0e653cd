"""Float8 scaling: ``quantize_fp8``, ``dequantize_fp8`` and the scaled matmul ``fp8_linear``.

A float8 tensor carries a float32 scale, per tensor (shape ``[]``) or per row (shape
``x.shape[:-1] + (1,)``), so that its real value is ``xq · scale``:

    amax  = max |x|                     (over the tensor, or over each row)
    scale = amax / fp8_max   if that is > 0, else 1          (all-zero input: scale 1)
    xq    = round_to_nearest_even(clamp(x / scale, −fp8_max, fp8_max))

    dequantize:  y = xq · scale
    fp8_linear:  y = (xq · x_scale) @ (wq · w_scale).T + bias
               = x_scale ⊙ (xq @ wq.T) ⊙ w_scale.T + bias     (the scales leave the sum)

``fp8_max`` is 448 for float8_e4m3fn and 57344 for float8_e5m2. The quotient is clamped before
rounding because float8_e4m3fn has no infinity: saturation is the contract, not overflow.
None of these kernels is differentiable (training recipes put their own gradients around them).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from ..spec import (
    PARTIAL,
    Args,
    BadInput,
    Case,
    Check,
    KernelSpec,
    Placement,
    Strategy,
    compute_dtype,
    each_dim,
    identity,
    randn,
    row_cases,
    rows,
    strided,
    transposed,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GRANULARITIES = ("tensor", "row")


def quantize_fp8(
    x: Tensor, granularity: str = "tensor", fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[Tensor, Tensor]:
    """Scale ``x`` into the float8 range and round it.

    ``scale = amax(|x|) / fp8_max`` (per tensor or per row; 1 where amax is 0) and
    ``xq = saturate(x / scale)`` rounded to nearest even. ``x``: ``[..., D]``, float;
    ``granularity``: ``"tensor"`` or ``"row"``; ``fp8_dtype``: ``torch.float8_e4m3fn`` or
    ``torch.float8_e5m2``. Returns ``(xq, scale)``: xq like x in ``fp8_dtype``, scale float32
    (float64 for float64 x) of shape ``[]`` (tensor) or ``x.shape[:-1] + (1,)`` (row).
    Not differentiable.
    """
    raise AssertionError("signature only: call backend.quantize_fp8")


def dequantize_fp8(xq: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``y = xq · scale``, computed in float32 (float64 for float64) and rounded to ``dtype``.

    ``xq``: ``[..., D]`` float8 (e4m3fn or e5m2); ``scale``: float32, shape ``[]`` or
    ``xq.shape[:-1] + (1,)``; ``dtype``: a float dtype of the backend. Returns ``y`` like xq in
    ``dtype``. Not differentiable.
    """
    raise AssertionError("signature only: call backend.dequantize_fp8")


def fp8_linear(
    xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor, bias: Optional[Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Scaled float8 matmul: ``y = (xq · x_scale) @ (wq · w_scale).T + bias``, float32 accumulation.

    ``xq``: ``[..., K]`` float8; ``x_scale``: float32, ``[]`` or ``xq.shape[:-1] + (1,)``;
    ``wq``: ``[N, K]`` float8 (either float8 dtype, independently of xq); ``w_scale``: float32,
    ``[]`` or ``[N, 1]``; ``bias``: ``[N]`` in ``out_dtype`` or float32, or None; ``out_dtype``:
    a float dtype of the backend. Returns ``y [..., N]`` in ``out_dtype``. Not differentiable.
    """
    raise AssertionError("signature only: call backend.fp8_linear")


# ---------------------------------------------------------------------------------------------
# Validation.


def _fp32(c: Check) -> tuple[torch.dtype, ...]:
    """Scales (and a bias) are float32; a float64 backend, the oracle, also takes float64 ones."""
    return (torch.float32, torch.float64) if torch.float64 in c.dtypes else (torch.float32,)


def _scale(c: Check, arg: str, scale: Any, like: Tensor, like_name: str, row_shape: tuple[int, ...]) -> None:
    c.tensor(arg, scale, dtypes=_fp32(c))
    c.same_device(arg, scale, like)
    if scale.dim() != 0 and tuple(scale.shape) != row_shape:
        raise c.fail(arg, f"has shape {tuple(scale.shape)}; expected () (per tensor) or {row_shape} "
                          f"(per row of '{like_name}')")


def validate_quantize_fp8(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("quantize_fp8", dtypes)
    c.tensor("x", a["x"], min_ndim=1)
    c.choice("granularity", a["granularity"], GRANULARITIES)
    c.choice("fp8_dtype", a["fp8_dtype"], FP8_DTYPES)
    return a


def validate_dequantize_fp8(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("dequantize_fp8", dtypes)
    xq = c.tensor("xq", a["xq"], min_ndim=1, dtypes=FP8_DTYPES)
    _scale(c, "scale", a["scale"], xq, "xq", (*xq.shape[:-1], 1))
    c.choice("dtype", a["dtype"], c.dtypes)
    return a


def validate_fp8_linear(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("fp8_linear", dtypes)
    xq = c.tensor("xq", a["xq"], min_ndim=1, dtypes=FP8_DTYPES)
    wq = c.tensor("wq", a["wq"], ndim=2, dtypes=FP8_DTYPES)
    c.same_device("wq", wq, xq)
    if wq.shape[1] != xq.shape[-1]:
        raise c.fail("wq", f"has shape {tuple(wq.shape)}; expected [N, {xq.shape[-1]}] (K of xq)")
    _scale(c, "x_scale", a["x_scale"], xq, "xq", (*xq.shape[:-1], 1))
    _scale(c, "w_scale", a["w_scale"], xq, "wq", (wq.shape[0], 1))
    out_dtype = c.choice("out_dtype", a["out_dtype"], c.dtypes)
    if a["bias"] is not None:
        c.tensor("bias", a["bias"], dtypes=tuple(dict.fromkeys((out_dtype, *_fp32(c)))))
        c.shape("bias", a["bias"], (wq.shape[0],))
        c.same_device("bias", a["bias"], xq)
    return a


# ---------------------------------------------------------------------------------------------
# Reference math.


def _amax(x: Tensor, granularity: str) -> Tensor:
    """``max |x|`` per tensor (``[]``) or per row (``[..., 1]``); 0 over an empty range."""
    a = x.abs()
    if granularity == "row":
        return a.amax(-1, keepdim=True) if x.shape[-1] > 0 else a.new_zeros(*x.shape[:-1], 1)
    return a.amax() if x.numel() > 0 else a.new_zeros(())


def _saturate(t: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    fp8_max = torch.finfo(fp8_dtype).max
    t = t.clamp(-fp8_max, fp8_max)
    if t.dtype == torch.float64:
        # torch converts float64 to float8 through float32, rounding twice (1.0625 + 2^-40 becomes
        # 1.0 in e4m3, not 1.125); rounding to float32 "to odd" first makes the second rounding exact
        f = t.to(torch.float32)
        f = torch.where(f.double().abs() > t.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
        t = (f.view(torch.int32) | (f.double() != t).to(torch.int32)).view(torch.float32)
    return t.to(fp8_dtype)


def _compute(*dtypes: torch.dtype) -> torch.dtype:
    """float64 when a scale, the bias or the output is float64 (the oracle), else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def quantize_fp8_fwd(x: Tensor, granularity: str, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Returns ``(xq, scale)``."""
    # contiguous: elementwise results keep a transposed input's layout, outputs must not
    xc = x.to(compute_dtype(x.dtype)).contiguous()
    scale = _amax(xc, granularity) / torch.finfo(fp8_dtype).max
    # also catches an amax so small that the division underflows to 0; a NaN amax (a NaN in the
    # row or tensor) stays NaN, and so does every value quantized with it
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return _saturate(xc / scale, fp8_dtype), scale


def dequantize_fp8_fwd(xq: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    ct = _compute(scale.dtype, dtype)
    return ((xq.to(ct).contiguous() * scale.to(ct)).to(dtype),)


def fp8_linear_fwd(
    xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype
) -> tuple[Tensor]:
    """Returns ``(y,)``."""
    ct = _compute(x_scale.dtype, w_scale.dtype, out_dtype, out_dtype if bias is None else bias.dtype)
    # products of two float8 values are exact in float32, so only the sum rounds
    acc = rows(xq).to(ct) @ wq.to(ct).T
    sx = rows(x_scale).to(ct) if x_scale.dim() > 0 else x_scale.to(ct)
    y = acc * sx * w_scale.to(ct).reshape(1, -1)
    if bias is not None:
        y = y + bias.to(ct)
    return (y.to(out_dtype).reshape(*xq.shape[:-1], wq.shape[0]),)


def _quantize_flops(a: Args) -> float:
    # |x| and max for the amax, one division and one clamp per element
    return 4.0 * a["x"].numel()


def _dequantize_flops(a: Args) -> float:
    return 1.0 * a["xq"].numel()


def _fp8_linear_flops(a: Args) -> float:
    m = math.prod(a["xq"].shape[:-1])
    n, k = a["wq"].shape
    return 2.0 * m * n * k


# ---------------------------------------------------------------------------------------------
# Conformance inputs. Float8 operands are drawn as float8 values directly (a normal sample
# scaled to cover most of the format's range), scales as positive float32 numbers.


def _fp8(g: torch.Generator, *shape: int, fp8_dtype: torch.dtype, layout=identity) -> Tensor:
    # a standard deviation of 1/8 of the max: values over most of the exponent range
    return layout(_saturate(randn(g, *shape, dtype=torch.float32, scale=torch.finfo(fp8_dtype).max / 8),
                            fp8_dtype))


def _scales(g: torch.Generator, shape: tuple[int, ...], magnitude: float) -> Tensor:
    return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).mul(magnitude).to(torch.float32)


def _make_quantize(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
                   layout=identity, granularity: str = "row", fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                   zero_rows: int = 0) -> Args:
    x = randn(g, *shape, dtype=dtype, scale=scale)
    x[..., :zero_rows, :] = 0.0
    return {"x": layout(x), "granularity": granularity, "fp8_dtype": fp8_dtype}


def _quantize_cases() -> list[Case]:
    def case(name: str, **kw: Any) -> Case:
        return Case(name, lambda g, dtype: _make_quantize(g, dtype, **kw), grad=False)

    return row_cases(_make_quantize, (16384, 8192)) + [
        case("tensor", shape=(4, 32, 4096), granularity="tensor"),
        case("tensor_odd", shape=(17, 1000), granularity="tensor"),
        case("tensor_strided", shape=(33, 1024), granularity="tensor", layout=strided),
        case("tensor_zero_size", shape=(0, 64), granularity="tensor"),
        case("transposed", shape=(256, 96), layout=transposed),
        case("tensor_transposed", shape=(256, 96), granularity="tensor", layout=transposed),
        case("e5m2_row", shape=(64, 1024), fp8_dtype=torch.float8_e5m2),
        case("e5m2_tensor", shape=(64, 1024), granularity="tensor", fp8_dtype=torch.float8_e5m2),
        case("e5m2_huge", shape=(8, 2048), fp8_dtype=torch.float8_e5m2, scale=1e4),
        # all-zero rows and tensors take scale 1, never 0/0
        case("zero_rows_of_values", shape=(6, 256), zero_rows=3),
        case("all_zero_tensor", shape=(6, 256), granularity="tensor", zero_rows=6),
    ]


def _make_dequantize(g: torch.Generator, dtype: torch.dtype, *, shape: tuple[int, ...], scale: float = 1.0,
                     layout=identity, granularity: str = "row",
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> Args:
    xq = _fp8(g, *shape, fp8_dtype=fp8_dtype, layout=layout)
    # |y| <= 3 · scale: within float16 for the "huge" scale of 1e4
    magnitude = scale * 2.0 / torch.finfo(fp8_dtype).max
    scale_shape = (*shape[:-1], 1) if granularity == "row" else ()
    return {"xq": xq, "scale": _scales(g, scale_shape, magnitude), "dtype": dtype}


def _dequantize_cases() -> list[Case]:
    def case(name: str, **kw: Any) -> Case:
        return Case(name, lambda g, dtype: _make_dequantize(g, dtype, **kw), grad=False)

    return row_cases(_make_dequantize, (16384, 8192)) + [
        case("tensor", shape=(4, 32, 4096), granularity="tensor"),
        case("tensor_strided", shape=(33, 1024), granularity="tensor", layout=strided),
        case("transposed", shape=(256, 96), layout=transposed),
        case("e5m2_row", shape=(64, 1024), fp8_dtype=torch.float8_e5m2),
        case("e5m2_tensor", shape=(17, 1000), granularity="tensor", fp8_dtype=torch.float8_e5m2),
    ]


def _make_fp8_linear(g: torch.Generator, dtype: torch.dtype, *, m: tuple[int, ...], n: int, k: int,
                     x_rows: bool = True, w_rows: bool = True, bias: Optional[str] = "float32",
                     x_fp8: torch.dtype = torch.float8_e4m3fn, w_fp8: torch.dtype = torch.float8_e4m3fn,
                     x_layout=identity, w_layout=identity) -> Args:
    xq = _fp8(g, *m, k, fp8_dtype=x_fp8, layout=x_layout)
    wq = _fp8(g, n, k, fp8_dtype=w_fp8, layout=w_layout)
    # each float8 operand has a standard deviation of fp8_max / 8: scale the product of the
    # dequantized operands to about unit variance after a sum of k terms
    mx = 8.0 / torch.finfo(x_fp8).max / max(k, 1) ** 0.25
    mw = 8.0 / torch.finfo(w_fp8).max / max(k, 1) ** 0.25
    return {
        "xq": xq,
        "x_scale": _scales(g, (*m, 1) if x_rows else (), mx),
        "wq": wq,
        "w_scale": _scales(g, (n, 1) if w_rows else (), mw),
        "bias": None if bias is None else randn(g, n, dtype=dtype if bias == "out_dtype" else torch.float32),
        "out_dtype": dtype,
    }


def _fp8_linear_cases() -> list[Case]:
    def case(name: str, perf: bool = False, **kw: Any) -> Case:
        return Case(name, lambda g, dtype: _make_fp8_linear(g, dtype, **kw), grad=False, perf=perf)

    e5m2 = torch.float8_e5m2
    return [
        case("llm", m=(256,), n=384, k=512),
        case("tensor_scales", m=(256,), n=384, k=512, x_rows=False, w_rows=False, bias=None),
        case("mixed_scales", m=(64,), n=128, k=256, x_rows=False),
        case("bias_out_dtype", m=(64,), n=128, k=256, bias="out_dtype"),
        case("batched", m=(2, 17), n=64, k=128),
        case("e4m3_e5m2", m=(64,), n=128, k=256, w_fp8=e5m2),
        case("e5m2_e4m3", m=(64,), n=128, k=256, x_fp8=e5m2),
        case("single", m=(1,), n=1, k=1),
        case("odd", m=(17,), n=3, k=1000),
        case("strided_x", m=(33,), n=64, k=128, x_layout=strided),
        # a weight stored [K, N] used as its transpose: the column-major operand of FP8 GEMMs
        case("transposed_w", m=(33,), n=64, k=128, w_layout=transposed),
        case("zero_m", m=(0,), n=64, k=128),
        case("zero_k", m=(8,), n=64, k=0),
        case("perf", m=(8192,), n=8192, k=8192, x_rows=False, w_rows=False, bias=None, perf=True),
    ]


# ---------------------------------------------------------------------------------------------
# Bad inputs.


def _quantize_bad() -> list[BadInput]:
    base = {"x": torch.randn(4, 8), "granularity": "row", "fp8_dtype": torch.float8_e4m3fn}
    return [
        BadInput("int_x", lambda: {**base, "x": torch.ones(4, 8, dtype=torch.int64)}),
        BadInput("fp8_x", lambda: {**base, "x": torch.zeros(4, 8, dtype=torch.float8_e4m3fn)}),
        BadInput("scalar_x", lambda: {**base, "x": torch.tensor(1.0)}),
        BadInput("granularity", lambda: {**base, "granularity": "block"}),
        BadInput("fp8_dtype", lambda: {**base, "fp8_dtype": torch.float16}),
        BadInput("not_a_tensor", lambda: {**base, "x": [[1.0, 2.0]]}),
    ]


def _dequantize_bad() -> list[BadInput]:
    base = {"xq": torch.zeros(4, 8, dtype=torch.float8_e4m3fn), "scale": torch.ones(4, 1),
            "dtype": torch.bfloat16}
    return [
        BadInput("float_xq", lambda: {**base, "xq": torch.zeros(4, 8)}),
        BadInput("scale_shape", lambda: {**base, "scale": torch.ones(4)}),
        BadInput("scale_dtype", lambda: {**base, "scale": torch.ones(4, 1, dtype=torch.float16)}),
        BadInput("scale_device", lambda: {**base, "scale": torch.ones(4, 1, device="meta")}),
        BadInput("out_dtype", lambda: {**base, "dtype": torch.int32}),
    ]


def _fp8_linear_bad() -> list[BadInput]:
    def fp8(*shape: int) -> Tensor:
        return torch.zeros(*shape, dtype=torch.float8_e4m3fn)

    base = {"xq": fp8(4, 8), "x_scale": torch.ones(4, 1), "wq": fp8(6, 8), "w_scale": torch.ones(6, 1),
            "bias": torch.zeros(6), "out_dtype": torch.bfloat16}
    return [
        BadInput("float_xq", lambda: {**base, "xq": torch.zeros(4, 8, dtype=torch.bfloat16)}),
        BadInput("wq_3d", lambda: {**base, "wq": fp8(1, 6, 8)}),
        BadInput("wq_k", lambda: {**base, "wq": fp8(6, 9)}),
        BadInput("x_scale_shape", lambda: {**base, "x_scale": torch.ones(6, 1)}),
        BadInput("w_scale_shape", lambda: {**base, "w_scale": torch.ones(1, 6)}),
        BadInput("w_scale_dtype", lambda: {**base, "w_scale": torch.ones(6, 1, dtype=torch.bfloat16)}),
        BadInput("bias_shape", lambda: {**base, "bias": torch.zeros(4)}),
        BadInput("bias_dtype", lambda: {**base, "bias": torch.zeros(6, dtype=torch.float16)}),
        BadInput("wq_device",
                 lambda: {**base, "wq": torch.zeros(6, 8, dtype=torch.float8_e4m3fn, device="meta")}),
        BadInput("out_dtype", lambda: {**base, "out_dtype": torch.float8_e4m3fn}),
    ]


def _quantize_sharding(a: Args) -> list[Strategy]:
    """Per row: any leading dimension sharded; per tensor none (one scale from the whole amax)."""
    if a["granularity"] == "tensor":
        return []
    return each_dim(range(a["x"].ndim - 1), ("xq", "scale"), ("x",))


def _dequantize_sharding(a: Args) -> list[Strategy]:
    """Any dimension sharded (per-row scales with the rows)."""
    last = a["xq"].ndim - 1
    strategies = each_dim(range(last), ("y",), ("xq", "scale") if a["scale"].ndim > 0 else ("xq",))
    strategies.append(({"y": last}, {"xq": last}))
    return strategies


def _fp8_linear_sharding(a: Args) -> list[Strategy]:
    """As linear without an activation; per-row scales shard with their rows."""
    last = a["xq"].ndim - 1
    x_rows = a["x_scale"].ndim > 0
    w_rows = a["w_scale"].ndim > 0
    strategies: list[Strategy] = [({"y": d}, {"xq": d, **({"x_scale": d} if x_rows else {})}) for d in range(last)]
    column: dict[str, Placement] = {"wq": 0, "bias": 0, **({"w_scale": 0} if w_rows else {})}
    strategies.append(({"y": last}, column))
    strategies.append(({"y": PARTIAL}, {"xq": last, "wq": 1, "bias": PARTIAL}))
    return strategies


QUANTIZE_FP8 = KernelSpec(
    name="quantize_fp8",
    signature=quantize_fp8,
    validate=validate_quantize_fp8,
    forward=quantize_fp8_fwd,
    outputs=("xq", "scale"),
    flops=_quantize_flops,
    cases=_quantize_cases,
    bad_inputs=_quantize_bad,
    sharding=_quantize_sharding,
    memory_bound=True,
)

DEQUANTIZE_FP8 = KernelSpec(
    name="dequantize_fp8",
    signature=dequantize_fp8,
    validate=validate_dequantize_fp8,
    forward=dequantize_fp8_fwd,
    outputs=("y",),
    flops=_dequantize_flops,
    cases=_dequantize_cases,
    bad_inputs=_dequantize_bad,
    sharding=_dequantize_sharding,
    memory_bound=True,
)

FP8_LINEAR = KernelSpec(
    name="fp8_linear",
    signature=fp8_linear,
    validate=validate_fp8_linear,
    forward=fp8_linear_fwd,
    outputs=("y",),
    flops=_fp8_linear_flops,
    cases=_fp8_linear_cases,
    bad_inputs=_fp8_linear_bad,
    sharding=_fp8_linear_sharding,
)

SPECS = (QUANTIZE_FP8, DEQUANTIZE_FP8, FP8_LINEAR)
