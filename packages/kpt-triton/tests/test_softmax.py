from __future__ import annotations

import pytest
import torch

from conftest import check_kernel, seeded
from kpt.spec import randn, strided
from kpt_triton import softmax as k
from kpt_triton import tiling

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)

CASES = {
    "odd": ((3, 17), 1),
    "single": ((1, 1), 1),
    "dim0": ((37, 5), 0),
    "middle": ((3, 29, 4), 1),
    "zero_rows": ((0, 8), 1),
    "zero_dim": ((4, 0, 3), 1),
}


def _check(x, dim, dtype, **tuning):
    def fwd(*a):
        return k.softmax_fwd(*a, **tuning)

    def bwd(*a):
        return k.softmax_bwd(*a, **tuning)

    check_kernel("softmax", fwd, bwd, {"x": x, "dim": dim}, dtype)


@pytest.mark.parametrize("shape,dim", CASES.values(), ids=CASES.keys())
def test_shapes(dtype, shape, dim):
    g = seeded(shape)
    _check(randn(g, *shape, dtype=dtype, scale=3.0), dim, dtype)


@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_layouts(dtype, layout):
    g = torch.Generator().manual_seed(1)
    x = randn(g, 9, 40, dtype=dtype)
    x = strided(x) if layout == "strided" else x.t().contiguous().t()
    _check(x, 1, dtype)


@pytest.mark.parametrize("dim", [0, 1])
def test_chunked_rows(dtype, dim):
    # rows longer than one chunk take the running-maximum path, several rows per program
    g = torch.Generator().manual_seed(2)
    _check(randn(g, 45, 45, dtype=dtype, scale=3.0), dim, dtype, max_block=16, tile_elems=32)


def test_rows_past_max_block_take_chunks(dtype):
    # rows up to max_block are read once; a longer one is read in chunks of `chunk` columns
    g = torch.Generator().manual_seed(4)
    x = randn(g, 5, 45, dtype=dtype, scale=3.0)
    _check(x, 1, dtype, max_block=32, chunk=8, tile_elems=32)
    _check(x[:, :30], 1, dtype, max_block=32, chunk=8, tile_elems=32)


def test_backward_tiles_by_row_width(dtype, monkeypatch):
    """``tile_elems_at`` gives rows of one width their own tile: four 16-wide rows a program here,
    where ``tile_elems`` alone gives one; rows of other widths keep ``tile_elems``, those in blocks of
    the same width (12) among them."""
    tiles = []

    def spy(d, **kw):
        tiles.append(tiling.row_tiling(d, **kw))
        return tiles[-1]

    monkeypatch.setattr(k, "row_tiling", spy)
    g = torch.Generator().manual_seed(6)
    for width, expected in ((16, (4, 16)), (12, (1, 16)), (30, (1, 32))):
        tiles.clear()
        x = randn(g, 9, width, dtype=dtype, scale=3.0)
        check_kernel("softmax", k.softmax_fwd, lambda *a: k.softmax_bwd(*a, max_block=32, tile_elems=16,
                                                                tile_elems_at=((16, 64),)), {"x": x, "dim": 1}, dtype)
        assert tiles and tiles[-1] == expected


@pytest.mark.parametrize("block", [16, 64], ids=["chunked", "whole"])
def test_extreme_forward(dtype, block):
    # magnitudes of 1e4 overflow a softmax that does not subtract the maximum. Forward only: with
    # a near one-hot y the gradient cancels beyond float32 (and the reference's) accuracy.
    g = torch.Generator().manual_seed(3)
    x = randn(g, 7, 45, dtype=dtype, scale=1e4)
    check_kernel("softmax", lambda *a: k.softmax_fwd(*a, max_block=block), None, {"x": x, "dim": 1}, dtype)


@pytest.mark.parametrize("masked", [8, 20, 45])
def test_a_masked_head_of_whole_chunks(dtype, masked):
    # leading chunks of −inf add nothing to the running sum (not exp(−inf + inf) = NaN); a row that
    # is −inf throughout is NaN, as the reference's 0/0
    g = torch.Generator().manual_seed(5)
    x = randn(g, 3, 45, dtype=dtype, scale=3.0)
    x[:, :masked] = -float("inf")
    _check(x, 1, dtype, max_block=32, chunk=8, tile_elems=32)



SPLIT_CASES = {
    "one_row": ((1, 5000), 1, False, True),
    "three_rows": ((3, 4100), 1, False, True),
    "along_dim0": ((5000, 2), 0, False, True),  # outer 1, inner 2: each row is a strided column
    "strided": ((1, 5000), 1, True, True),
    # the rows of [2, D, 2] are not one strided matrix: they stay whole
    "outer_and_inner": ((2, 3000, 2), 1, False, False),
    # rows the whole-row kernel reads in two chunks: split only from four multiprocessors a row
    "two_chunks_four_rows": ((4, 2000), 1, False, True),
    "two_chunks_eight_rows": ((8, 2000), 1, False, False),
    # in three chunks: from two
    "three_chunks_eight_rows": ((8, 3000), 1, False, True),
}


@pytest.mark.parametrize("shape,dim,is_strided,split", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_few_rows_are_cut_into_spans(dtype, monkeypatch, shape, dim, is_strided, split):
    # 16 multiprocessors and 1024-column chunks: a 5000-wide row is 5 spans, one program each
    # (1024-column whole-row reads: rows of 3 or more chunks are split from 2 spans a row up)
    monkeypatch.setattr(tiling, "multiprocessor_count", lambda device: 16)
    g = torch.Generator().manual_seed(6)
    x = randn(g, *shape, dtype=dtype, scale=3.0)
    x = strided(x) if is_strided else x
    assert (k._spans(k._as_3d(x, dim), 1024, 1024) is not None) == split
    _check(x, dim, dtype, chunk=1024, max_block=1024)


@pytest.mark.parametrize("masked", [2100, 5000])
def test_a_masked_head_across_spans(dtype, monkeypatch, masked):
    # whole spans of −inf add nothing when the row's statistics are merged; all −inf is NaN (0/0)
    monkeypatch.setattr(tiling, "multiprocessor_count", lambda device: 16)
    g = torch.Generator().manual_seed(7)
    x = randn(g, 2, 5000, dtype=dtype, scale=3.0)
    x[:, :masked] = -float("inf")
    _check(x, 1, dtype, chunk=1024, max_block=1024)


def _padded(x, pad):
    """``x`` as the first columns of rows ``pad`` elements wider (a row stride other than its width)."""
    return torch.cat([x, torch.zeros(x.shape[0], pad, dtype=x.dtype)], 1)[:, :x.shape[1]]


ALIGNED_CASES = {
    # rows of 2051 start at every offset within a 16-byte vector: heads and tails read apart
    "odd_width": (lambda x: x, True),
    "row_stride_2059": (lambda x: _padded(x, 8), True),  # starts at the offsets of y's rows
    "row_stride_2060": (lambda x: _padded(x, 9), False),  # at other offsets than y's: not aligned
    "unaligned_base": (lambda x: _padded(x, 1)[:, 1:], False),
}


@pytest.mark.parametrize("tuning", [{}, {"max_block": 1024, "chunk": 512, "tile_elems": 512}],
                         ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("case", ALIGNED_CASES)
def test_odd_widths_one_row_a_program_in_aligned_vectors(dtype, monkeypatch, case, tuning):
    # one row a program, no spans; 2051 columns (not a multiple of 16) take the span kernel with its
    # own statistics and aligned vectors where every tensor's rows start alike within a vector
    monkeypatch.setattr(tiling, "multiprocessor_count", lambda device: 1)
    layout, aligned = ALIGNED_CASES[case]
    g = torch.Generator().manual_seed(8)
    x = layout(randn(g, 9, 2051 + (case == "unaligned_base"), dtype=dtype, scale=3.0))
    y = torch.empty(x.shape, dtype=dtype)
    vec = tiling.row_vector(x.shape[1], (x, x.stride(0), x.stride(1)), (y, y.stride(0), 1))
    assert vec == (16 // x.element_size() if aligned else 1)
    _check(x, 1, dtype, **tuning)

