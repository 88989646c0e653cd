"""The vendor-native softmax (`kpt_cuda.onchip`'s kernels without a target): which calls they take
(any machine) and what they compute (GPU with CuPy)."""

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


def test_backward_takes_the_rows_the_forward_takes(monkeypatch):
    """The backward hands the same calls to the portable kernel, and also one whose ``dy`` the CUDA C
    kernel cannot read alike with ``y`` (another dtype, rows that start elsewhere modulo a vector),
    or whose rows are narrower than ``BACKWARD_MIN_WIDTH``."""
    calls = []
    monkeypatch.setattr(native.portable, "softmax_bwd", lambda x, dim, y, dy, **kw: calls.append((x.shape, dim)))
    launched = []
    monkeypatch.setattr(onchip, "softmax_backward", lambda *a: launched.append(a[-1]))
    # as on an H100: the device's checks left out, the layout's kept
    monkeypatch.setattr(onchip, "split_for", lambda rows, width, *alike:
                        onchip.onchip_split(rows, 232448, *alike) if rows.shape[1] >= width else None)
    monkeypatch.setattr(native, "BACKWARD_MIN_WIDTH", 0)
    for shape, dim in (((4, 64), 1), ((4, 65, 3), 1)):
        x = torch.empty(shape, dtype=torch.bfloat16)
        native.softmax_bwd(x, dim, x, x, max_block=64)
    x = torch.empty(4, 72, dtype=torch.bfloat16)
    native.softmax_bwd(x, 1, x, torch.empty(4, 72), max_block=64)  # dy in float32
    native.softmax_bwd(x, 1, x, torch.empty(4, 76, dtype=torch.bfloat16)[:, :72], max_block=64)
    assert calls == [((4, 64), 1), ((4, 65, 3), 1), ((4, 72), 1), ((4, 72), 1)] and not launched
    dy = torch.empty(4, 80, dtype=torch.bfloat16)[:, :72]  # rows 160 bytes apart: aligned like y's
    native.softmax_bwd(x, 1, x, dy, max_block=64)
    assert len(calls) == 4 and launched == [(0, 1, 0)]
    monkeypatch.setattr(native, "BACKWARD_MIN_WIDTH", 73)
    native.softmax_bwd(x, 1, x, dy, max_block=64)
    assert len(calls) == 5 and len(launched) == 1


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
    ((140, 256000), 0, torch.bfloat16, 3.0),  # Gemma: 12 vectors a thread off chip
    ((133, 256003), 8, torch.bfloat16, 30.0),  # off chip, with a head and a tail
    ((9, 140000), 4, torch.float32, 3.0),
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
@pytest.mark.parametrize("v", [40000, 40003, 256003])
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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape, pad, dtype", [
    ((300, 50257), 8, torch.bfloat16),  # dy's rows apart by more than V; a head, whole vectors, a tail
    ((133, 32001), 0, torch.float16),
    ((2, 70, 65536), 0, torch.bfloat16),
    ((140, 128256), 0, torch.bfloat16),
    ((140, 151937), 0, torch.float16),
    ((9, 40000), 4, torch.float32),
])
def test_backward_matches_float64(monkeypatch, shape, pad, dtype):
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    monkeypatch.setattr(native, "BACKWARD_MIN_WIDTH", 0)
    launched = []
    backward = onchip.softmax_backward
    monkeypatch.setattr(onchip, "softmax_backward", lambda *a: launched.append(1) or backward(*a))
    *lead, v = shape
    x = (torch.randn(*lead, v, device="cuda") * 3).to(dtype)
    y = torch.softmax(x.float(), -1).to(dtype)
    dy = torch.randn(*lead, v + pad, device="cuda").to(dtype)[..., :v]
    before = y.clone(), dy.clone()
    with poisoned():
        (dx,) = native.softmax_bwd(x, x.dim() - 1, y, dy, max_block=16384)
    assert launched, "the call did not reach the CUDA C kernel"
    assert torch.equal(y, before[0]) and torch.equal(dy, before[1])
    assert dx.shape == x.shape and dx.dtype == dtype and not dx.isnan().any()
    yd, dyd = y.cpu().double(), dy.cpu().double()
    dot = (yd * dyd).sum(-1, keepdim=True)
    ref = yd * (dyd - dot)
    # the output's rounding, float32 sums over the row, and near 0 the dtype's smallest step
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    step = max(torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps, torch.finfo(torch.float32).smallest_normal)
    bound = tol * ref.abs() + 1e-5 * yd * (dyd.abs() + (yd * dyd).abs().sum(-1, keepdim=True)) + step
    err = (dx.cpu().double() - ref).abs()
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [40000, 40003])
def test_backward_special_values_as_the_reference(monkeypatch, dtype, v):
    """A NaN row of y (the forward's of a row of -inf), NaN and ±inf in dy: the NaN and inf
    positions of the contract's float64 reference, finite values close."""
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    monkeypatch.setattr(native, "BACKWARD_MIN_WIDTH", 0)
    x = torch.randn(6, v, device="cuda").to(dtype)
    y = torch.softmax(x.float(), -1).to(dtype)
    dy = torch.randn(6, v, device="cuda").to(dtype)
    y[1] = float("nan")
    dy[2, 7] = float("nan")
    dy[3, 11] = float("inf")
    dy[4, 0], dy[4, v - 1] = float("-inf"), float("inf")
    (dx,) = native.softmax_bwd(x, 1, y, dy, max_block=16384)
    (want,) = kpt.SPECS["softmax"].backward(x.cpu().double(), 1, y.cpu().double(), dy.cpu().double())
    want = want.to(dtype).double()
    got = dx.double().cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-2, atol=1e-5)
