"""The vendor-native softmax forward (`kpt_cuda.onchip` without a target): which calls it takes (any
machine) and what it computes (GPU with CuPy)."""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.testing import poisoned
from kpt_cuda import onchip
from kpt_cuda import softmax as native


def test_short_rows_and_other_dims_go_to_the_portable_kernel(monkeypatch):
    """Rows the portable kernel reads once (up to ``max_block``), a softmax over another dimension,
    and CPU tensors never reach the CUDA C kernel."""
    calls = []
    monkeypatch.setattr(native.portable, "softmax_fwd", lambda x, dim, **kw: calls.append((x.shape, dim, kw)))
    monkeypatch.setattr(onchip, "launch", lambda *a, **kw: pytest.fail("the CUDA C kernel was launched"))
    native.softmax_fwd(torch.empty(4, 64), 1, max_block=64, stream=True)
    native.softmax_fwd(torch.empty(4, 65, 3), 1, max_block=64)
    native.softmax_fwd(torch.empty(4, 65), 1, max_block=64)  # a CPU tensor
    assert [(shape, dim, kw["max_block"], kw["stream"]) for shape, dim, kw in calls] == [
        ((4, 64), 1, 64, True), ((4, 65, 3), 1, 64, False), ((4, 65), 1, 64, False)]


gpu = pytest.mark.skipif(not native.available(), reason="needs CuPy and a CUDA GPU: the CUDA C kernel runs only there")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape, pad, dtype, scale", [
    ((300, 50257), 8, torch.bfloat16, 3.0),  # rows of a head, whole vectors and a tail
    ((133, 32001), 0, torch.float16, 3.0),
    ((2, 70, 65536), 0, torch.bfloat16, 30.0),  # contiguous 3-D, logits in the hundreds
    ((140, 128256), 0, torch.bfloat16, 3.0),
    ((140, 151937), 0, torch.float16, 3.0),
    ((9, 40000), 4, torch.float32, 3.0),
])
def test_matches_float64(monkeypatch, shape, pad, dtype, scale):
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    launched = []
    launch = onchip.launch
    monkeypatch.setattr(onchip, "launch", lambda *a, **kw: launched.append(1) or launch(*a, **kw))
    *lead, v = shape
    x = (torch.randn(*lead, v + pad, device="cuda") * scale).to(dtype)[..., :v]  # rows apart by more than V
    x_before = x.clone()
    with poisoned():  # outputs start as NaN: an element never written fails below
        (y,) = native.softmax_fwd(x, x.dim() - 1, max_block=16384)
    assert launched, "the call did not reach the CUDA C kernel"
    assert torch.equal(x, x_before) and y.shape == x.shape and y.dtype == dtype
    ref = torch.softmax(x.cpu().double(), -1)
    assert not y.isnan().any()
    # relative, elementwise; near 0 the dtype's own step (float16's subnormals are 6e-8 apart) or
    # float32's smallest normal (the kernel's exponentials flush float32 subnormals to 0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    step = max(torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps, torch.finfo(torch.float32).smallest_normal)
    err = (y.cpu().double() - ref).abs()
    assert (err <= tol * ref + step).all(), (err / (tol * ref + step)).max()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [40000, 40003])
def test_special_values_as_the_reference(monkeypatch, dtype, v):
    """NaN, ±inf and ±max: the same NaN and inf positions as the float64 reference of the contract,
    finite values close."""
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    x = torch.randn(8, v, device="cuda").to(dtype)
    big = torch.finfo(dtype).max
    x[1, 7] = float("nan")
    x[2, 11] = float("inf")
    x[3, 5] = float("-inf")
    x[4] = float("-inf")  # every value -inf: NaN, as torch
    x[5, 100], x[5, v - 1] = float("inf"), float("inf")
    x[6, 0] = big
    x[7, 0], x[7, v - 1] = big, -big
    (y,) = native.softmax_fwd(x, 1, max_block=16384)
    (want,) = kpt.SPECS["softmax"].forward(x.cpu().double(), 1)
    want = want.to(dtype).double()
    got = y.double().cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-2, atol=1e-3)
