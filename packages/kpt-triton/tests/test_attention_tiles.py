"""`kpt_triton.attention_tiles`: every tile choice fits the shared memory (LDS) of every AOT target,
at every head dim the contract accepts, in every dtype, with and without a mask."""

from __future__ import annotations

import pytest
import torch

import kpt
from kpt.kernels.attention import HEAD_DIMS
from kpt_triton import aot
from kpt_triton import attention_tiles as at

HEAD_DIM_RANGE = range(HEAD_DIMS[0], HEAD_DIMS[1] + 1)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LIMITS = sorted({t.shared_limit for t in aot.TARGETS.values()} | {at.SMALLEST_SHARED})

OVERSIZED = {d: at.Tiles(256, 256, 8, 5) for d in (16, 32, 64, 128, 256)}
"""A table no GPU holds: `fit` has to shrink it everywhere."""


def _bwd_need(t, block_d, dtype):
    return at.shared_bytes(max(t.block_m, t.block_n), t.block_m, t.block_n, block_d, t.num_stages, dtype, True)


def _fwd_need(t, block_d, dtype, masked):
    return at.shared_bytes(t.block_n, t.block_m, t.block_n, block_d, t.num_stages, dtype,
                           masked or dtype == torch.float32)


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("table", [None, OVERSIZED], ids=["portable", "oversized"])
def test_every_head_dim_and_dtype_fits_every_target(limit, table):
    for head_dim in HEAD_DIM_RANGE:
        for dtype in DTYPES:
            for masked in (False, True):
                block_d, fwd = at.launch_tiles(head_dim, dtype, table, table, False, masked, limit)
                assert block_d >= head_dim and _fwd_need(fwd, block_d, dtype, masked) <= limit
                _, bwd = at.launch_tiles(head_dim, dtype, table, table, True, masked, limit)
                assert _bwd_need(bwd, block_d, dtype) <= limit
                assert min(fwd.block_m, fwd.block_n, bwd.block_m, bwd.block_n, fwd.num_stages) >= 1
                for rows in range(1, at.decode_rows(dtype, block_d, fwd, at.PORTABLE_DECODE) + 1):
                    d = at.decode_tiles(rows, block_d, dtype, fwd, at.PORTABLE_DECODE, masked, limit)
                    assert d.block_m >= rows
                    assert at.shared_bytes(d.block_n, d.block_m, d.block_n, block_d, d.num_stages, dtype,
                                           masked or dtype == torch.float32) <= limit


def test_tiles_that_fit_are_kept():
    # the H200's forward at head dim 128 (kpt-cuda's sm90-hbm3e table): 229376 of 232448 bytes
    h200 = at.Tiles(128, 128, 8, 3)
    assert at.fit(h200, 128, torch.bfloat16, False, False, aot.TARGETS["sm90"].shared_limit) == h200
    assert at.launch_tiles(80, torch.bfloat16, None, None, False, False, 1 << 30)[1] == at.portable_tiles(
        128, torch.bfloat16, False)


def test_the_decode_kernel_at_head_dim_80_in_float32_fits_gfx942():
    # before the fit: 16 rows x 64 keys in 2 stages asked 69632 bytes of gfx942's 65536 (AOT check)
    _, fwd = at.launch_tiles(80, torch.float32, None, None, False, False, aot.TARGETS["gfx942"].shared_limit)
    d = at.decode_tiles(1, 128, torch.float32, fwd, at.PORTABLE_DECODE, False, aot.TARGETS["gfx942"].shared_limit)
    assert d.block_m == 16 and (d.block_n, d.num_stages) != (64, 2)


def test_shrinking_keeps_what_it_can():
    # stages first, then the streamed rows: keys forward, the larger of queries and keys backward
    assert at.fit(at.Tiles(64, 64, 4, 4), 64, torch.bfloat16, False, False, 41000) == at.Tiles(64, 64, 4, 2)
    assert at.fit(at.Tiles(64, 128, 4, 2), 128, torch.bfloat16, False, False, 90000) == at.Tiles(64, 64, 4, 2)
    t = at.fit(at.Tiles(128, 32, 4, 2), 128, torch.bfloat16, True, False, 65536)
    assert t.block_n == 32 and t.block_m < 128


def test_a_limit_below_the_smallest_tiles_is_refused_in_one_line():
    refused = r"head dim 256 in torch.float32 needs \d+ bytes .* has 1024$"
    with pytest.raises(kpt.KernelNotSupportedError, match=refused):
        at.launch_tiles(256, torch.float32, None, None, True, False, 1024)
    with pytest.raises(kpt.KernelNotSupportedError, match="decoding 16 query rows of head dim 256"):
        at.decode_tiles(16, 256, torch.float32, at.Tiles(16, 16, 4, 1), at.PORTABLE_DECODE, False, 1024)


def test_the_interpreter_keeps_the_smallest_gpus_limit():
    assert at.shared_memory(torch.device("cpu")) == at.SMALLEST_SHARED == min(
        t.shared_limit for t in aot.TARGETS.values())
