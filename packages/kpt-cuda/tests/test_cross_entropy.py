"""The vendor-native cross-entropy (`kpt_cuda.onchip` with a target): what it computes (GPU with CuPy;
where it is wired: `test_onchip`)."""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.testing import poisoned
from kpt_cuda import cross_entropy as native
from kpt_cuda import onchip


@pytest.mark.gpu
@pytest.mark.skipif(not native.available(), reason="needs CuPy and a CUDA GPU: the CUDA C kernel runs nowhere else")
@pytest.mark.parametrize("n, v, dtype, eps, reduction, ignored, scale", [
    (8, 128256, torch.bfloat16, 0.0, "mean", 0.1, 3.0),
    (7, 128256, torch.bfloat16, 0.1, "mean", 0.1, 3.0),
    (300, 128256, torch.bfloat16, 0.0, "sum", 0.1, 3.0),  # more rows than blocks: the next-row loads
    (5, 151936, torch.bfloat16, 0.0, "none", 0.0, 3.0),
    (33, 32000, torch.float16, 0.0, "none", 0.1, 3.0),
    (9, 65536, torch.float32, 0.05, "mean", 0.1, 3.0),
    (2, 8, torch.bfloat16, 0.0, "mean", 0.0, 3.0),
    (200, 50304, torch.bfloat16, 0.0, "mean", 1.0, 3.0),  # every target ignored
    (40, 128256, torch.bfloat16, 0.0, "mean", 0.1, 30.0),  # logits in the hundreds
    # widths that are not a whole number of vectors: each row a head, whole vectors and a tail
    (300, 50257, torch.bfloat16, 0.0, "mean", 0.1, 3.0),
    (133, 32001, torch.float16, 0.1, "sum", 0.1, 3.0),
    (9, 65537, torch.float32, 0.0, "none", 0.0, 3.0),
    (200, 128255, torch.bfloat16, 0.05, "mean", 0.1, 30.0),
    (5, 3, torch.bfloat16, 0.0, "none", 0.0, 3.0),  # no whole vector at all
    (6, 13, torch.float16, 0.1, "none", 0.0, 3.0),
])
def test_matches_float64(monkeypatch, n, v, dtype, eps, reduction, ignored, scale):
    monkeypatch.setattr(native, "ONCHIP_MIN_V", 1)
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    z = (torch.randn(n, v + 8, device="cuda") * scale).to(dtype)[:, :v]  # rows apart by more than V
    target = torch.randint(0, v, (n,), device="cuda")
    edges = torch.tensor([0, v - 1, min(1, v - 1), max(v - 2, 0)], device="cuda")[:n]
    target[: len(edges)] = edges  # the first and last columns: a row's head and tail where it has them
    target[torch.rand(n, device="cuda") < ignored] = -100
    z_before = z.clone()
    assert onchip.onchip_split(z, torch.cuda.get_device_properties().shared_memory_per_block_optin)
    with poisoned():  # outputs start as NaN: an element never written fails below
        loss, dz = native.cross_entropy_fwd(z, target, -100, eps, reduction, True)
    # the contract's float64 reference: the loss and the gradient for an upstream gradient of 1
    ref_loss, ref_dz = kpt.SPECS["cross_entropy"].forward(z.cpu().double(), target.cpu(), -100, eps, reduction, True)
    assert torch.equal(z, z_before)
    assert not dz.isnan().any() and not loss.isnan().any()
    # the loss and the gradient are rounded to the logits' dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=tol, atol=1e-5)
    # the gradient's error against its largest entry
    err = (dz.double().cpu() - ref_dz).abs().max()
    assert err <= tol * ref_dz.abs().max().clamp(min=1e-30) or err == 0


@pytest.mark.gpu
@pytest.mark.skipif(not native.available(), reason="needs CuPy and a CUDA GPU: the CUDA C kernel runs nowhere else")
def test_out_of_range_target_gives_nan(monkeypatch):
    monkeypatch.setattr(native, "ONCHIP_MIN_V", 1)
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    z = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    loss, _ = native.cross_entropy_fwd(z, torch.tensor([0, 1024, -100], device="cuda"), -100, 0.0, "none", True)
    assert loss[0].isfinite() and loss[1].isnan() and loss[2] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not native.available(), reason="needs CuPy and a CUDA GPU: the CUDA C kernel runs nowhere else")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("v", [32000, 32003])
def test_special_values_as_the_reference(monkeypatch, dtype, eps, v):
    """NaN, ±inf and ±max logits: the same NaN and inf positions as the float64 reference in the
    loss of every row and its gradient, finite values close (an H100 gave a +inf logit's row a NaN
    loss and NaN gradient everywhere, and a ±max logit's row inf gradients, before the kernel took
    its exponents of differences and kept a row's +inf or NaN maximum as its lse)."""
    monkeypatch.setattr(native, "ONCHIP_MIN_V", 1)
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    n = 11
    z = torch.randn(n, v, device="cuda").to(dtype)
    target = torch.randint(0, v, (n,), device="cuda")
    big = torch.finfo(dtype).max
    z[1, 7] = float("nan")
    z[2, 11] = float("inf")
    z[3, 5] = float("-inf")
    z[4, 3], z[4, 9] = float("nan"), float("inf")  # NaN beside +inf: NaN
    z[5] = float("nan")
    target[5] = -100  # an ignored row of NaN adds nothing
    z[6] = float("-inf")  # no class possible: NaN loss
    z[7, target[7]] = float("-inf")  # the target impossible: +inf loss
    z[8, 100], z[8, 200] = float("inf"), float("inf")
    z[9, 0] = big
    z[10, 0], z[10, 1] = big, -big
    loss, dz = native.cross_entropy_fwd(z, target, -100, eps, "none", True)
    ref_loss, ref_dz = kpt.SPECS["cross_entropy"].forward(z.cpu().double(), target.cpu(), -100, eps, "none", True)
    for got, want in ((loss.double().cpu(), ref_loss), (dz.double().cpu(), ref_dz.to(dtype).double())):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.isposinf(), want.isposinf()) and torch.equal(got.isneginf(), want.isneginf())
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-2, atol=1e-2 * want[finite].abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not native.available(), reason="needs CuPy and a CUDA GPU: the CUDA C kernel runs nowhere else")
@pytest.mark.parametrize("v", [4096, 4099])
def test_large_logits_lose_no_precision_to_the_log_sum_exp(monkeypatch, v):
    """float32 logits near ±1e4 whose largest two lie within 2: a row whose target is its maximum has
    a loss near log 2. A log-sum-exp kept as one float32 sum is half an ulp of 1e4 (2^-11) off, 1e-3
    of that loss; the kernel keeps the maximum and log Σ exp apart."""
    monkeypatch.setattr(native, "ONCHIP_MIN_V", 1)
    monkeypatch.setattr(onchip, "MIN_ROWS_PER_SM", 0)
    n = 64
    z = (torch.rand(n, v, device="cuda") * 2 - 1) * 1e4
    top = z.argmax(1)
    z[:, 0] = z[torch.arange(n), top] - torch.rand(n, device="cuda") * 2  # the runner-up
    target = torch.where(torch.arange(n, device="cuda") % 2 == 0, top, torch.zeros_like(top))
    loss, dz = native.cross_entropy_fwd(z, target, -100, 0.0, "none", True)
    ref_loss, ref_dz = kpt.SPECS["cross_entropy"].forward(z.cpu().double(), target.cpu(), -100, 0.0, "none", True)
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dz.double().cpu(), ref_dz, rtol=0, atol=2e-6)
