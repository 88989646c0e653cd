"""The vendor-native cross-entropy: where it runs (any machine) and what it computes (GPU with CuPy)."""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.testing import poisoned
from kpt_cuda import backend
from kpt_cuda import cross_entropy as native

H100_SMEM = 232448
"""Shared memory one block may use on an H100 (and the H200)."""


@pytest.mark.parametrize("shape, dtype, split", [
    ((8192, 128256), torch.bfloat16, (2, 14)),  # docs/performance.md: 16032 vectors, 16 per thread
    ((4, 151936), torch.float16, (5, 14)),
    ((4, 32000), torch.bfloat16, (0, 4)),
    ((4, 8), torch.bfloat16, (0, 1)),
    ((4, 65536), torch.float32, (2, 14)),
    ((4, 163848), torch.bfloat16, None),  # 21 vectors per thread: more than fit
    ((4, 128256), torch.float32, None),
    ((4, 128250), torch.bfloat16, None),  # not a whole number of 16-byte vectors
    ((4, 64), torch.float64, None),
    ((0, 64), torch.bfloat16, None),
])
def test_onchip_split(shape, dtype, split):
    assert native.onchip_split(torch.empty(shape, dtype=dtype), H100_SMEM) == split


def test_onchip_split_needs_aligned_contiguous_rows():
    wide = torch.empty(4, 1032, dtype=torch.bfloat16)
    assert native.onchip_split(wide[:, :1024], H100_SMEM) == (0, 1)  # rows 2064 bytes apart: aligned
    assert native.onchip_split(wide[:, 4:1028], H100_SMEM) is None  # starts 8 bytes in
    assert native.onchip_split(torch.empty(4, 1028, dtype=torch.bfloat16)[:, :1024], H100_SMEM) is None
    assert native.onchip_split(torch.empty(1024, 4, dtype=torch.bfloat16).t(), H100_SMEM) is None


def test_wired_only_where_cupy_runs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(native, "available", lambda: False)
    kernels = backend.CudaBackend().kernels()
    assert kernels["cross_entropy"].forward.body.__module__ == "kpt_triton.cross_entropy"
    monkeypatch.setattr(native, "available", lambda: True)
    kernels = backend.CudaBackend().kernels()
    assert kernels["cross_entropy"].forward.body is native.cross_entropy_fwd
    assert kernels["cross_entropy"].backward.body is native.cross_entropy_bwd
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = backend.CudaBackend().kernels()
    assert kernels["cross_entropy"].forward.body.__module__ == "kpt_triton.cross_entropy"


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
])
def test_matches_float64(monkeypatch, n, v, dtype, eps, reduction, ignored, scale):
    monkeypatch.setattr(native, "ONCHIP_MIN_V", 1)
    z = (torch.randn(n, v + 8, device="cuda") * scale).to(dtype)[:, :v]  # rows apart by more than V
    target = torch.randint(0, v, (n,), device="cuda")
    target[torch.rand(n, device="cuda") < ignored] = -100
    z_before = z.clone()
    assert native.onchip_split(z, torch.cuda.get_device_properties().shared_memory_per_block_optin)
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
    z = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    loss, _ = native.cross_entropy_fwd(z, torch.tensor([0, 1024, -100], device="cuda"), -100, 0.0, "none", True)
    assert loss[0].isfinite() and loss[1].isnan() and loss[2] == 0
