"""`kpt_cuda.onchip`: the kernels wired to it, which rows the CUDA C kernel takes, and how it splits
them between registers and shared memory (any machine; what it computes is tested through its
kernels, `test_cross_entropy` and `test_softmax`)."""

from __future__ import annotations

import pytest
import torch

from kpt_cuda import backend, cross_entropy, onchip, softmax


@pytest.mark.parametrize("native", [cross_entropy, softmax], ids=["cross_entropy", "softmax"])
def test_wired_only_where_cupy_runs(monkeypatch, native):
    kernel = native.__name__.rsplit(".", 1)[-1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(native, "available", lambda: False)
    kernels = backend.CudaBackend().kernels()
    assert kernels[kernel].forward.body.__module__ == f"kpt_triton.{kernel}"
    monkeypatch.setattr(native, "available", lambda: True)
    kernels = backend.CudaBackend().kernels()
    assert kernels[kernel].forward.body is getattr(native, f"{kernel}_fwd")
    assert kernels[kernel].backward.body is getattr(native, f"{kernel}_bwd")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = backend.CudaBackend().kernels()
    assert kernels[kernel].forward.body.__module__ == f"kpt_triton.{kernel}"


H100_SMEM = 232448
"""Shared memory one block may use on an H100 (and the H200)."""


@pytest.mark.parametrize("shape, dtype, split", [
    ((8192, 128256), torch.bfloat16, (2, 14, 0)),  # docs/performance.md: 16032 vectors, 16 per thread
    ((4, 151936), torch.float16, (5, 14, 0)),
    ((4, 32000), torch.bfloat16, (0, 4, 0)),
    ((4, 8), torch.bfloat16, (0, 1, 0)),
    ((4, 65536), torch.float32, (2, 14, 0)),
    ((4, 163848), torch.bfloat16, None),  # 21 vectors per thread: more than fit
    ((4, 128256), torch.float32, None),
    ((4, 128250), torch.bfloat16, (2, 14, 0)),  # not a whole number of vectors: 16031 whole ones
    ((4, 50257), torch.bfloat16, (0, 7, 0)),  # GPT-2
    ((4, 3), torch.bfloat16, (0, 0, 0)),  # no whole vector: a head only
    ((4, 64), torch.float64, None),
    ((0, 64), torch.bfloat16, None),
])
def test_onchip_split(shape, dtype, split):
    assert onchip.onchip_split(torch.empty(shape, dtype=dtype), H100_SMEM) == split


@pytest.mark.parametrize("shape, dtype, split", [
    ((4, 256000), torch.bfloat16, (6, 14, 12)),  # Gemma: 32 vectors a thread, 12 of them off chip
    ((4, 163848), torch.bfloat16, (6, 14, 1)),
    ((4, 128256), torch.float32, (6, 14, 12)),
    ((4, 8192 * 40), torch.bfloat16, (6, 14, 20)),  # half the row off chip: the most taken
    ((4, 8192 * 40 + 8), torch.bfloat16, None),
    ((4, 128256), torch.bfloat16, (2, 14, 0)),  # fits: nothing spilled
])
def test_onchip_split_of_the_forward_spills_up_to_half_a_row(shape, dtype, split):
    assert onchip.onchip_split(torch.empty(shape, dtype=dtype), H100_SMEM, spill=True) == split


def test_onchip_split_needs_an_aligned_base_and_rows_aligned_like_the_outputs():
    """The output is contiguous: a row of it starts where the input's row does modulo a vector
    only when the input's row stride equals the width modulo a vector."""
    wide = torch.empty(4, 1032, dtype=torch.bfloat16)
    assert onchip.onchip_split(wide[:, :1024], H100_SMEM) == (0, 1, 0)  # rows 2064 bytes apart: aligned
    assert onchip.onchip_split(wide[:, 4:1028], H100_SMEM) is None  # starts 8 bytes in
    assert onchip.onchip_split(torch.empty(4, 1028, dtype=torch.bfloat16)[:, :1024], H100_SMEM) is None
    assert onchip.onchip_split(wide[:, :1023], H100_SMEM) is None  # stride 1032, width 1023
    assert onchip.onchip_split(torch.empty(4, 1031, dtype=torch.bfloat16)[:, :1023], H100_SMEM) == (0, 1, 0)
    assert onchip.onchip_split(torch.empty(1, 1031, dtype=torch.bfloat16)[:, :1023], H100_SMEM) == (0, 1, 0)
    assert onchip.onchip_split(torch.empty(1024, 4, dtype=torch.bfloat16).t(), H100_SMEM) is None
