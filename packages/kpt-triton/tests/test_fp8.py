from __future__ import annotations

import pytest
import torch

from conftest import check_kernel, device, seeded
from kpt.spec import randn, strided
from kpt_triton import fp8 as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SHAPES = {"odd": (3, 17), "rows3d": (2, 5, 33), "single": (1, 1), "zero_rows": (0, 8), "zero_cols": (4, 0)}


def _ids(d):
    return str(d).removeprefix("torch.")


@pytest.mark.parametrize("fp8_dtype", FP8, ids=_ids)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_quantize(dtype, granularity, fp8_dtype, shape):
    g = seeded(shape)
    args = {"x": randn(g, *shape, dtype=dtype, scale=3.0), "granularity": granularity, "fp8_dtype": fp8_dtype}
    check_kernel("quantize_fp8", k.quantize_fp8_fwd, None, args, dtype)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_quantize_layouts_and_zeros(dtype, granularity):
    g = torch.Generator().manual_seed(1)
    x = strided(randn(g, 9, 40, dtype=dtype))
    x[3] = 0  # an all-zero row: scale 1, not 0/0
    kw = {"max_block": 16, "tile_elems": 32, "block": 64, "programs_per_sm": 1}
    args = {"x": x, "granularity": granularity, "fp8_dtype": torch.float8_e4m3fn}
    check_kernel("quantize_fp8", lambda *a: k.quantize_fp8_fwd(*a, **kw), None, args, dtype)
    zeros = k.quantize_fp8_fwd(torch.zeros(4, 8, dtype=dtype, device=device()), granularity, torch.float8_e4m3fn)[1]
    assert (zeros == 1).all()


def test_quantize_saturates():
    x = torch.tensor([[1.0, -2.0, 3.0]], device=device())
    xq, scale = k.quantize_fp8_fwd(x, "tensor", torch.float8_e4m3fn)
    assert scale.item() == pytest.approx(3.0 / 448) and xq.float()[0, 2] == 448 and xq.float()[0, 1] < 0


def _fp8(g, *shape, fp8_dtype):
    return (randn(g, *shape, dtype=torch.float32, scale=torch.finfo(fp8_dtype).max / 8)
            .clamp(-torch.finfo(fp8_dtype).max, torch.finfo(fp8_dtype).max).to(fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8, ids=_ids)
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor_scale", "row_scale"])
def test_dequantize(dtype, fp8_dtype, per_row):
    g = torch.Generator().manual_seed(2)
    xq = _fp8(g, 3, 5, 21, fp8_dtype=fp8_dtype)
    scale = torch.rand(3, 5, 1, generator=g) + 0.01 if per_row else torch.rand((), generator=g) + 0.01
    args = {"xq": xq, "scale": scale, "dtype": dtype}
    check_kernel("dequantize_fp8", lambda *a: k.dequantize_fp8_fwd(*a, block=16), None, args, dtype)


@pytest.mark.parametrize("bias", [None, "out", "fp32"])
@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
def test_fp8_linear_fallback(dtype, scales, bias):
    g = torch.Generator().manual_seed(3)
    xq = _fp8(g, 2, 3, 32, fp8_dtype=torch.float8_e4m3fn)
    wq = _fp8(g, 16, 32, fp8_dtype=torch.float8_e5m2)
    x_scale = torch.rand((2, 3, 1) if scales != "tensor" else (), generator=g) / 100
    w_scale = torch.rand((16, 1) if scales == "row" else (), generator=g) / 100
    b = None if bias is None else randn(g, 16, dtype=dtype if bias == "out" else torch.float32)
    args = {"xq": xq, "x_scale": x_scale, "wq": wq, "w_scale": w_scale, "bias": b, "out_dtype": dtype}
    check_kernel("fp8_linear", k.fp8_linear_fwd, None, args, dtype)


@pytest.mark.parametrize("case", ["tensor", "row", "odd_k", "e5m2_both", "fp32_out_bias"])
def test_scaled_mm_rules(case):
    # which calls may take torch._scaled_mm (it raises on the others; checked here without a GPU)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    k_dim = 30 if case == "odd_k" else 32
    xq = torch.zeros(4, k_dim, dtype=e5 if case == "e5m2_both" else e4)
    wq = torch.zeros(16, k_dim, dtype=e5 if case == "e5m2_both" else e4)
    row = case == "row"
    sx, sw = (torch.ones(4, 1), torch.ones(16, 1)) if row else (torch.ones(()), torch.ones(()))
    out = torch.float32 if case == "fp32_out_bias" else torch.bfloat16
    bias = torch.zeros(16, dtype=out) if case == "fp32_out_bias" else None
    got = k._scaled_mm_operands(xq, sx, wq, sw, bias, out)
    assert (got is not None) == (case in ("tensor", "row"))
    if row:
        assert got[0].shape == (4, 1) and got[1].shape == (1, 16)


@pytest.mark.parametrize("fp8_dtype", FP8, ids=_ids)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_quantize_bit_exact(granularity, fp8_dtype):
    # magnitudes over 11 decades: every binade, the subnormals and the flush to zero; the result
    # must be torch's round-to-nearest-even of the same float32 quotient, bit for bit
    x = torch.randn(16, 257) * torch.logspace(-8, 3, 257)
    xq, scale = k.quantize_fp8_fwd(x.to(device()), granularity, fp8_dtype)
    fp8_max = torch.finfo(fp8_dtype).max
    expected = (x / scale.cpu()).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    assert torch.equal(xq.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", FP8, ids=_ids)
def test_dequantize_every_bit_pattern(fp8_dtype):
    # the kernel decodes the bits itself: all 256 patterns (subnormals, NaN, inf) as torch does
    xq = torch.arange(256, dtype=torch.uint8).view(fp8_dtype)
    (y,) = k.dequantize_fp8_fwd(xq.to(device()), torch.ones((), device=device()), torch.float32)
    expected = xq.float()
    assert ((y.cpu() == expected) | (y.cpu().isnan() & expected.isnan())).all()
