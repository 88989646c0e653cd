"""The float8 specs against independent formulas: quantization checked against a brute-force
search over every float8 value, dequantization and the scaled matmul against float64 F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kpt

REF = kpt.get_backend("reference")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _finite_values(fp8_dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, sorted, as float64."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(torch.float64)
    return values[torch.isfinite(values)].unique()


def _nearest(target: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The distance from each target to the closest finite float8 value, and the value found."""
    values = _finite_values(fp8_dtype)
    dist = (target.reshape(-1, 1) - values).abs()
    best = dist.min(-1)
    return best.values.reshape(target.shape), values[best.indices].reshape(target.shape)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_quantize_rounds_to_the_nearest_float8_value(granularity: str, fp8_dtype: torch.dtype) -> None:
    x = torch.randn(3, 7, 40, generator=_gen(), dtype=torch.float64) * torch.logspace(-3, 3, 7)[:, None]
    xq, scale = REF.quantize_fp8(x, granularity, fp8_dtype)
    fp8_max = torch.finfo(fp8_dtype).max
    if granularity == "tensor":
        assert scale.shape == ()
        expected_scale = x.abs().max() / fp8_max
    else:
        assert scale.shape == (3, 7, 1)
        expected_scale = x.abs().amax(-1, keepdim=True) / fp8_max
    torch.testing.assert_close(scale, expected_scale, rtol=1e-15, atol=0)
    assert xq.dtype == fp8_dtype and xq.shape == x.shape
    target = x / scale
    distance, _ = _nearest(target, fp8_dtype)
    # the chosen value is a nearest one (ties may go either way here; torch rounds them to even)
    assert torch.equal((xq.double() - target).abs(), distance)
    # each scale maps its largest magnitude exactly onto the format's maximum
    assert xq.double().abs().amax() == fp8_max


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_scale_is_float32_and_round_trips(dtype: torch.dtype) -> None:
    x = torch.randn(64, 256, generator=_gen()).to(dtype)
    xq, scale = REF.quantize_fp8(x, "row")
    assert scale.dtype == torch.float32
    back = REF.dequantize_fp8(xq, scale, torch.float32)
    # e4m3 keeps 3 fraction bits: half a step is 2^-4 relative, plus the subnormal spacing
    err = (back.double() - x.double()).abs()
    assert (err <= 2**-4 * x.double().abs() + 2**-10 * scale.double()).all()


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_all_zero_input_has_scale_one(fp8_dtype: torch.dtype) -> None:
    x = torch.randn(4, 16, generator=_gen())
    x[1] = 0.0
    xq, scale = REF.quantize_fp8(x, "row", fp8_dtype)
    assert scale[1].item() == 1.0 and (xq[1].float() == 0).all()
    assert (scale[[0, 2, 3]] != 1.0).all()
    xq, scale = REF.quantize_fp8(torch.zeros(5, 3), "tensor", fp8_dtype)
    assert scale.item() == 1.0 and (xq.float() == 0).all()


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_saturates_and_never_divides_by_zero(fp8_dtype: torch.dtype) -> None:
    # row 0: amax / fp8_max underflows float32 to 0, so the scale falls back to 1;
    # row 1: a subnormal scale rounded down, so amax / scale lands above fp8_max
    x = torch.tensor([[3e-44, -2.9e-44, 1e-45], [1e-40, -5e-41, 0.0], [6e4, -6.5e4, 1.0]])
    xq, scale = REF.quantize_fp8(x, "row", fp8_dtype)
    fp8_max = torch.finfo(fp8_dtype).max
    assert scale[0].item() == 1.0 and (xq[0].float() == 0).all()
    assert x[1, 0].item() / scale[1].item() > fp8_max
    assert xq[1, 0].item() == fp8_max
    assert torch.isfinite(xq.float()).all() and (xq.float().abs() <= fp8_max).all()


@pytest.mark.parametrize("granularity, shape", [("tensor", (0, 8)), ("row", (0, 8)), ("row", (3, 0)),
                                                ("tensor", (3, 0))])
def test_quantize_zero_size(granularity: str, shape: tuple[int, ...]) -> None:
    xq, scale = REF.quantize_fp8(torch.randn(shape), granularity)
    assert xq.shape == shape
    assert scale.shape == (() if granularity == "tensor" else (*shape[:-1], 1))
    assert (scale == 1.0).all()


def _fp8_values(g: torch.Generator, *shape: int, fp8_dtype: torch.dtype = FP8[0]) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * 20).clamp(-400, 400).to(fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("rowwise", [True, False])
def test_dequantize_multiplies_by_the_scale(fp8_dtype: torch.dtype, rowwise: bool) -> None:
    g = _gen()
    xq = _fp8_values(g, 2, 9, 33, fp8_dtype=fp8_dtype)
    scale = torch.rand((2, 9, 1) if rowwise else (), generator=g) + 0.01
    y = REF.dequantize_fp8(xq, scale, torch.float64)
    assert y.dtype == torch.float64
    assert torch.equal(y, xq.double() * scale.double())
    y16 = REF.dequantize_fp8(xq, scale, torch.bfloat16).double()
    # one bfloat16 rounding: at most half a step, 2^-8 relative (the float32 product adds 2^-24)
    assert ((y16 - y).abs() <= (2**-8 + 2**-23) * y.abs()).all()


@pytest.mark.parametrize("x_fp8, w_fp8", [(FP8[0], FP8[0]), (FP8[0], FP8[1]), (FP8[1], FP8[0])])
@pytest.mark.parametrize("x_rows, w_rows", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_matches_float64_linear_of_dequantized_operands(
    x_fp8: torch.dtype, w_fp8: torch.dtype, x_rows: bool, w_rows: bool, bias: bool
) -> None:
    g = _gen()
    xq = _fp8_values(g, 2, 5, 48, fp8_dtype=x_fp8)
    wq = _fp8_values(g, 24, 48, fp8_dtype=w_fp8)
    x_scale = torch.rand((2, 5, 1) if x_rows else (), generator=g) / 100
    w_scale = torch.rand((24, 1) if w_rows else (), generator=g) / 100
    b = torch.randn(24, generator=g) if bias else None
    y = REF.fp8_linear(xq, x_scale, wq, w_scale, b, torch.float64)
    expected = F.linear(xq.double() * x_scale.double(), wq.double() * w_scale.double(),
                        None if b is None else b.double())
    assert y.shape == (2, 5, 24) and y.dtype == torch.float64
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_fp8_linear_accumulates_in_float32_and_rounds_once() -> None:
    g = _gen()
    xq, wq = _fp8_values(g, 64, 1024), _fp8_values(g, 32, 1024)
    x_scale, w_scale = torch.rand(64, 1, generator=g) / 400, torch.rand((), generator=g) / 400
    y = REF.fp8_linear(xq, x_scale, wq, w_scale, None, torch.bfloat16)
    exact = F.linear(xq.double() * x_scale.double(), wq.double() * w_scale.double())
    assert y.dtype == torch.bfloat16
    scale = exact.abs().max()
    assert ((y.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5 * scale).all()


def test_fp8_linear_with_empty_reduction_is_the_bias() -> None:
    xq = torch.zeros(4, 0, dtype=torch.float8_e4m3fn)
    wq = torch.zeros(6, 0, dtype=torch.float8_e4m3fn)
    bias = torch.randn(6, generator=_gen())
    y = REF.fp8_linear(xq, torch.ones(4, 1), wq, torch.ones(()), bias, torch.float32)
    assert torch.equal(y, bias.expand(4, 6))
    assert REF.fp8_linear(xq[:0], torch.ones(0, 1), wq, torch.ones(()), bias, torch.float32).shape == (0, 6)


def test_float64_scales_only_on_a_float64_backend() -> None:
    spec = kpt.SPECS["dequantize_fp8"]
    args = {"xq": torch.zeros(2, 4, dtype=torch.float8_e4m3fn), "scale": torch.ones((), dtype=torch.float64),
            "dtype": torch.float32}
    spec.validate(dict(args), REF.dtypes)
    with pytest.raises(kpt.KernelInputError, match="scale"):
        spec.validate(dict(args), kpt.FLOAT_DTYPES)


def test_float64_quantize_rounds_once() -> None:
    # just above the midpoint of 1.0 and 1.125 (e4m3): a conversion through float32 would land on
    # the midpoint and round to even, 1.0
    x = torch.tensor([[448.0, 1.0625 + 2**-40, -(1.0625 + 2**-40), 1.0625]], dtype=torch.float64)
    xq, scale = REF.quantize_fp8(x, "tensor", torch.float8_e4m3fn)
    assert scale.item() == 1.0
    assert xq.double().tolist() == [[448.0, 1.125, -1.125, 1.0]]
