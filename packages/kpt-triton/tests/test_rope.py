from __future__ import annotations

import pytest
import torch

from conftest import check_kernel, device, seeded
from kpt.spec import randn, strided
from kpt.testing import to_device
from kpt_triton import rope as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

# (B, Hq, Hk, S, D, per-sequence tables)
SHAPES = {
    "gqa": (2, 4, 2, 9, 16, False),
    "per_sequence": (3, 2, 1, 5, 12, True),
    "single": (1, 1, 1, 1, 2, False),
    "odd_half": (1, 3, 1, 7, 10, True),
    "zero_seq": (2, 2, 1, 0, 8, False),
    "zero_batch": (0, 2, 1, 4, 8, True),
}


def _args(g, dtype, b, hq, hk, s, d, per_sequence, *, transposed=False):
    def heads(h):
        if transposed:
            return randn(g, b, s, h, d, dtype=dtype).transpose(1, 2)
        return randn(g, b, h, s, d, dtype=dtype)

    table = (b, s, d) if per_sequence else (s, d)
    # general tables (halves differ) so that a kernel assuming cos₁ = cos₂ fails
    cos, sin = randn(g, *table, dtype=dtype), randn(g, *table, dtype=dtype)
    if transposed:
        cos, sin = strided(cos), strided(sin)
    return {"q": heads(hq), "k": heads(hk), "cos": cos, "sin": sin}


def _check(args, dtype, **tuning):
    def fwd(*a):
        return k.rope_fwd(*a, **tuning)

    def bwd(*a):
        return k.rope_bwd(*a, **tuning)

    check_kernel("rope", fwd, bwd, args, dtype)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_shapes(dtype, shape):
    _check(_args(seeded(shape), dtype, *shape), dtype)


def test_transposed_small_tiles(dtype):
    # [B, S, H, D] storage viewed as [B, H, S, D], strided tables, several position blocks per head
    args = _args(torch.Generator().manual_seed(1), dtype, 2, 3, 1, 11, 8, True, transposed=True)
    _check(args, dtype, tile_elems=16)


def test_missing_output_gradient(dtype):
    args = to_device(_args(torch.Generator().manual_seed(2), dtype, 1, 2, 1, 3, 4, False), device())
    outs = k.rope_fwd(*args.values())
    dq, dk = k.rope_bwd(*args.values(), *outs, torch.randn_like(outs[0]), None)
    assert dk.shape == args["k"].shape and not dk.any() and dq.any()
