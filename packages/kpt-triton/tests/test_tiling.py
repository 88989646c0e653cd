"""The launchers' plain-Python size helpers agree with Triton's own; the norm forwards of narrow
rows are compiled without fused multiply-adds (`kpt_triton.tiling.row_statistics_options`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton

from kpt_triton import tiling
from kpt_triton.tiling import cdiv, next_pow2


def test_cdiv_matches_triton() -> None:
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_pow2_matches_triton() -> None:
    for n in [*range(1, 600), 4097, 65535, 65536, 128256, 2**31 - 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    # where Triton's gives 0, a block size of 1 is returned: a block never has size 0
    assert next_pow2(0) == 1


@pytest.mark.parametrize(("n", "expected"), [
    (4096, (512, 128)),  # one token: 8 tiles of 512 rather than one of 8192
    (14336, (512, 128)),
    (16 * 14336, (2048, 256)),  # a tile of about n / 132
    (64 * 14336, (8192, 512)),  # 112 tiles of 8192 already: the tuned values
    (4096 * 14336, (8192, 512)),
    (1, (512, 128)),
])
def test_spread_cuts_small_inputs_across_the_multiprocessors(monkeypatch, n, expected) -> None:
    monkeypatch.setattr(tiling, "multiprocessor_count", lambda device: 132)
    assert tiling.spread(n, 8192, 512, torch.device("cpu")) == expected
    # a tuned tile at or below the spread one is kept as it is
    assert tiling.spread(n, 512, 64, torch.device("cpu")) == (512, 64)


# compiled for sm90 in a fresh process (these tests run under the interpreter), the SASS read with
# the cuobjdump that Triton ships: which norm forwards keep multiply-add fusion
FUSED_MULTIPLY_ADDS = """
import os, subprocess, sys, tempfile, torch, triton
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.compiler import ASTSource
from kpt_triton import aot, layer_norm, rms_norm
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for name, width in (("layer_norm", 17), ("rms_norm", 17), ("layer_norm", 4096), ("rms_norm", 4096)):
    with aot._recording(aot.TARGETS["sm90"]) as launches, FakeTensorMode():
        x, w = torch.empty(3, width, dtype=torch.bfloat16), torch.empty(width, dtype=torch.bfloat16)
        if name == "layer_norm":
            layer_norm.layer_norm_fwd(x, w, w, 1e-5)
        else:
            rms_norm.rms_norm_fwd(x, w, 1e-6)
    (launch,) = launches
    options, signature, constexprs, attrs = aot._specialization(launch, aot.TARGETS["sm90"])
    compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=aot.TARGETS["sm90"].gpu,
                              options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"]); f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    print(name, width, sass.count("FFMA"), sep="|")
"""


def test_norm_forwards_of_narrow_rows_compile_without_fused_multiply_adds():
    # one element of a row per lane: lanes must round Σx² alike (`tiling.row_statistics_options`)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", FUSED_MULTIPLY_ADDS], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = {(name, int(width)): int(n) for name, width, n in (line.split("|") for line in done.stdout.split())}
    assert counts[("layer_norm", 17)] == counts[("rms_norm", 17)] == 0, counts
    assert counts[("layer_norm", 4096)] > 0 and counts[("rms_norm", 4096)] > 0, counts  # fusion stays on there


@pytest.mark.parametrize("d, rows, expected", [
    (4096, 1, (1, 4096)),      # a decode step's row: one row a tile, not four
    (4096, 3, (4, 4096)),      # the tuned four rows
    (17, 3, (4, 32)),          # 128 elements: cut to the rows there are
    (1, 1, (16384, 1)),        # a tile of one element is not made: the tuned tile stays
    (4096, None, (4, 4096)),
])
def test_row_tiling_holds_no_more_rows_than_there_are(d, rows, expected) -> None:
    assert tiling.row_tiling(d, max_block=16384, tile_elems=16384, rows=rows) == expected


@pytest.mark.parametrize("rows, d", [(1, 4096), (3, 17), (1000, 20000)])
def test_row_launch_is_row_tiling_computed_once_per_shape(rows, d) -> None:
    grid, options = tiling.row_launch(rows, d, 16384, 4096, 512, True, HAS_WEIGHT=False)
    block_r, block_d = tiling.row_tiling(d, max_block=16384, tile_elems=4096, rows=rows)
    assert grid == (tiling.cdiv(rows, block_r),)
    assert options == {"HAS_WEIGHT": False, "BLOCK_R": block_r, "BLOCK_D": block_d, "ONE_CHUNK": d <= block_d,
                       "num_warps": tiling.warps(block_r * block_d, 512), **tiling.row_statistics_options(block_d)}
    assert tiling.row_launch(rows, d, 16384, 4096, 512, True, HAS_WEIGHT=False)[1] is options
    assert "enable_fp_fusion" not in tiling.row_launch(rows, d, 16384, 4096, 512, HAS_WEIGHT=False)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_sums_of_one_program_are_the_gradient_itself(dtype) -> None:
    """One program of one-chunk rows writes the whole sum once in the parameter's dtype: the buffer
    is ``[d]`` and `total` returns it as it is (no reduction, cast or indexing); more programs, or
    chunked rows, get float32 partial rows that `total` sums and casts."""
    param = torch.ones(5, dtype=dtype)
    like = torch.empty(3, 5, dtype=dtype)
    one = tiling.partial_sums(param, 1, 5, True, like)
    assert one.shape == (5,) and one.dtype == dtype
    assert tiling.total(one, param) is one
    chunked = tiling.partial_sums(param, 1, 5, False, like)
    assert chunked.shape == (1, 5) and chunked.dtype == torch.float32 and not chunked.any()
    many = tiling.partial_sums(param, 3, 5, True, like)
    many.copy_(torch.arange(15, dtype=torch.float32).reshape(3, 5))
    summed = tiling.total(many, param)
    assert summed.dtype == dtype and torch.equal(summed, many.sum(0).to(dtype))
    assert tiling.partial_sums(None, 3, 5, True, like).numel() == 0


def test_dense_like_is_contiguous_whatever_the_layout() -> None:
    t = torch.empty(6, 4, dtype=torch.float16).t()
    out = tiling.dense_like(t)
    assert out.shape == t.shape and out.dtype == t.dtype and out.is_contiguous()


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    return t, t.stride(0), t.stride(1)


def test_row_vector_reads_aligned_vectors_only_where_every_row_starts_alike() -> None:
    odd = torch.empty(9, 2051, dtype=torch.bfloat16)
    wide = torch.empty(9, 2059, dtype=torch.bfloat16)  # row stride 8 more: the same offsets
    assert tiling.row_vector(2048, _rows(torch.empty(9, 2048, dtype=torch.bfloat16))) == 1  # Triton's own
    assert tiling.row_vector(2051, _rows(odd)) == 8
    assert tiling.row_vector(2051, _rows(odd.float())) == 4
    assert tiling.row_vector(2051, _rows(odd.double())) == 2
    assert tiling.row_vector(2051, _rows(odd), _rows(wide[:, :2051])) == 8
    assert tiling.row_vector(2051, _rows(odd), _rows(torch.empty(9, 2060, dtype=torch.bfloat16)[:, :2051])) == 1
    assert tiling.row_vector(2051, _rows(torch.empty(9, 2052, dtype=torch.bfloat16)[:, 1:])) == 1  # base
    assert tiling.row_vector(2051, _rows(torch.empty(9, 4102, dtype=torch.bfloat16)[:, ::2])) == 1  # columns
    assert tiling.row_vector(2051, _rows(odd), _rows(odd.float())) == 1  # element sizes differ
    assert tiling.row_vector(2051, _rows(torch.empty(9, 2051, dtype=torch.int8))) == 16  # one byte an element
