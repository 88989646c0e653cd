"""How the launchers cut their work into Triton programs.

Row-wise kernels (norms, softmax, per-row fp8, cross-entropy) see their input as ``[R, D]``
rows and give each program a tile of ``BLOCK_R × BLOCK_D`` elements. A row wider than
``max_block`` columns is walked in chunks of ``BLOCK_D``; the kernels keep the first chunk in
registers, so a row that fits in one chunk is read from memory exactly once.

Element-wise kernels (activations, fp8 scaling) use the same tiles: a contiguous input is one
long row, a strided one keeps its own rows, so a column slice of a wider buffer (``gate, up =
proj.chunk(2, -1)``) is read in place instead of being copied first.

Backward kernels that reduce over rows (``dweight``) run a persistent grid of a few programs
per multiprocessor; each program sums its rows into its own row of a partial buffer, which the
launcher reduces afterwards: deterministic, no atomics.
"""

from __future__ import annotations

import functools
import os
from typing import Any, overload

import torch
import triton
import triton.language as tl

from kpt.spec import rows


def row_statistics_options(block_d: int) -> dict[str, bool]:
    """Compiler options for a kernel that stores a per-row statistic (rstd, mean) of rows tiled
    ``block_d`` columns wide: without multiply-add fusion where a lane may hold a single element of
    a row (``block_d <= 32``), the defaults elsewhere.

    With fusion, the first step of the lanes' butterfly reduction of ``Σ x²`` becomes
    ``fma(x_i, x_i, x_j²)`` in lane i and ``fma(x_j, x_j, x_i²)`` in its partner when each holds
    one element, so the lanes of a row may end one rounding apart; Triton then stores the row's
    value through shared memory with every one of those lanes writing the same address — a write
    race of two values, reported by compute-sanitizer's racecheck on an H100 (layer_norm, 17-wide
    rows: 13 of 400 calls; 0 of 400 without fusion). A lane with two elements or more sums them
    first and shuffles rounded partial sums, the same in every lane; rows reduced across warps end
    in shared memory, read alike by all. Fusion stays on there: without it layer_norm's forward
    took 1.5% longer at 65536 × 8192 on the H100."""
    return {"enable_fp_fusion": False} if block_d <= 32 else {}


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` for ``b > 0``. Launchers use these two plain-Python helpers for grid and block
    sizes: Triton's own (``triton.cdiv``, ``triton.next_power_of_2``) cost about 2 µs a call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``≥ n`` (1 for ``n ≤ 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def row_tiling(d: int, *, max_block: int, tile_elems: int, chunk: int | None = None,
               rows: int | None = None) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_D)`` for rows of ``d`` columns: whole rows up to ``max_block`` columns
    (longer rows in chunks of ``chunk`` columns, ``max_block`` if None), then enough rows per tile
    to reach about ``tile_elems`` elements, but no more than the ``rows`` there are (a decode step's
    one row gets a one-row tile, and the warps that one row needs) where such a tile keeps
    `MIN_TILE` elements."""
    block_d = min(next_pow2(d), max_block) if chunk is None or d <= max_block else chunk
    block_r = max(1, tile_elems // block_d)
    if rows is not None and next_pow2(rows) * block_d >= MIN_TILE:
        block_r = min(block_r, next_pow2(rows))
    return block_r, block_d


@functools.lru_cache(maxsize=4096)
def row_launch(n_rows: int, d: int, max_block: int, tile_elems: int, elems_per_warp: int, statistics: bool = False,
               chunk: int | None = None, **flags: Any) -> tuple[tuple[int], dict[str, Any]]:
    """The grid and keywords of a row kernel's launch (one tile of `row_tiling` a program) over
    ``n_rows`` rows of ``d`` columns (rows longer than ``max_block`` in chunks of ``chunk``):
    ``BLOCK_R``, ``BLOCK_D``, ``ONE_CHUNK`` (``d <= BLOCK_D``), ``num_warps`` (`warps`), the
    kernel's constexpr ``flags`` and, for a kernel that stores row ``statistics``,
    `row_statistics_options`. Computed once per shape, tuning and flags: a one-token launcher
    spent about 2 µs of host a call on them. The dict is shared by every launch of the shape
    (`cached_launch.launch` reads it): nothing may modify it."""
    block_r, block_d = row_tiling(d, max_block=max_block, tile_elems=tile_elems, chunk=chunk, rows=n_rows)
    options = {**flags, "BLOCK_R": block_r, "BLOCK_D": block_d, "ONE_CHUNK": d <= block_d,
               "num_warps": warps(block_r * block_d, elems_per_warp)}
    if statistics:
        options.update(row_statistics_options(block_d))
    return (cdiv(n_rows, block_r),), options


MIN_TILE = 128
"""The fewest elements of a tile that `row_tiling` cuts down to the rows there are: four a lane of
one warp. Smaller ones are not made: on an H100 a one-element layer_norm (1 × 1, float32) cut to a
1 × 1 tile got a wrong backward (relative error 1e302), the 2048 × 1 tile it keeps did not."""


def warps(tile: int, elems_per_warp: int, max_warps: int = 16) -> int:
    """A power-of-two warp count giving each warp about ``elems_per_warp`` elements of a tile."""
    return max(1, min(max_warps, next_pow2(tile // elems_per_warp)))


def dense_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous tensor of ``t``'s shape, dtype and device: a launcher's output.
    (``torch.empty(t.shape, dtype=t.dtype, device=t.device)`` reads three attributes in Python and
    parses three arguments: twice the host time.)"""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def as_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """2-D views of same-shaped tensors for an element-wise kernel: one row of every element
    when all are contiguous, else their ``[rows, last dim]`` views (strides kept)."""
    if all(t.is_contiguous() for t in tensors):
        return tuple(t.reshape(1, t.numel()) for t in tensors)
    return tuple(rows(t) for t in tensors)


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units, Xe cores) of ``device``; on CPU tensors, which
    only the Triton interpreter runs, the CPU count."""
    if device.type == "cpu":
        return os.cpu_count() or 1
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return int(props["multiprocessor_count"])


def persistent_programs(tiles: int, device: torch.device, programs_per_sm: int) -> int:
    """The grid of a persistent kernel: at most ``programs_per_sm`` per multiprocessor."""
    return min(tiles, multiprocessor_count(device) * programs_per_sm)




def row_split(n: int, v: int, block: int, device: torch.device, min_per_row: int = 2) -> tuple[int, int]:
    """``(block, span)`` for ``n`` rows of ``v`` columns read in chunks of ``block``: rows so few
    that every row has ``min_per_row`` multiprocessors or more are cut into spans of ``span``
    columns, one program each (chunks of at least 1024 columns), so that a decode step's softmax or
    loss is not one multiprocessor's work; otherwise ``(block, v)``, whole rows."""
    per_row = multiprocessor_count(device) // max(n, 1)
    if per_row < min_per_row or v <= block:
        return block, v
    block = min(block, max(1024, next_pow2(cdiv(v, per_row))))
    return block, cdiv(cdiv(v, per_row), block) * block


def partial_sums(param: torch.Tensor | None, programs: int, d: int, one_chunk: bool,
                 like: torch.Tensor) -> torch.Tensor:
    """The buffer into which a backward's persistent programs write their partial sums of the
    gradient of ``param`` (``[d]``): one float32 row per program, zeros where rows are wider than one
    chunk (later chunks add into it). A single program of one-chunk rows (a decode step's) writes the
    whole sum once, in ``param``'s dtype, into a ``[d]`` buffer that is the gradient itself (`total`:
    no reduction, no cast, no indexing). Without ``param``, an empty tensor of the dtype of ``like``
    (the input), which `total` returns."""
    if param is None:
        return like.new_empty(0)
    if programs == 1 and one_chunk:
        return torch.empty(d, dtype=param.dtype, device=like.device)
    return (torch.empty if one_chunk else torch.zeros)(programs, d, dtype=torch.float32, device=like.device)


def total(part: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """The gradient of ``param`` from the buffer of `partial_sums` (that buffer without ``param``)."""
    if param is None or part.dim() == 1:
        return part
    return (part[0] if part.shape[0] == 1 else part.sum(0)).to(param.dtype)


def spread(n: int, block: int, elems_per_warp: int, device: torch.device) -> tuple[int, int]:
    """``(block, elems_per_warp)`` for an element-wise kernel over ``n`` elements: the tuned values,
    except where ``n`` makes fewer tiles than there are multiprocessors (a decode step's
    activations, whose time is latency, not bandwidth): then a tile of about ``n / multiprocessors``
    elements (at least 512) in up to 8 warps, 4 to 8 elements a thread. On an H100 a 14336-wide
    silu took 1.9 µs on the GPU as 2 tiles of 8192, 1.2 µs as 28 of 512 (gelu 2.8 → 1.2,
    ``benchmarks/h100-2026-11-27.md``)."""
    units = multiprocessor_count(device)
    tile = max(512, next_pow2(cdiv(n, units)))
    if tile >= block:
        return block, elems_per_warp
    return tile, min(elems_per_warp, max(128, tile // 8))

@triton.jit
def nan_max(a, axis):
    """The maximum of ``a`` along ``axis``, NaN where any element is NaN (as torch.amax: a GPU's
    maximum instruction, which tl.max uses, drops NaN)."""
    return tl.where(tl.max((a != a).to(tl.int32), axis=axis) > 0, float("nan"), tl.max(a, axis=axis))


@triton.jit
def load_tile(PTR, rows, cols, stride_r, stride_c, mask):
    """The tile ``rows × cols`` of a strided matrix (``rows`` int64), loaded as float32: one
    64-bit base per row plus 32-bit column offsets (no 64-bit arithmetic per element)."""
    ptrs = (PTR + rows * stride_r)[:, None] + (cols * stride_c)[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@overload
def vector(t: torch.Tensor) -> torch.Tensor: ...
@overload
def vector(t: None) -> None: ...
def vector(t: torch.Tensor | None) -> torch.Tensor | None:
    """A vector argument (a weight, a bias, targets) as the kernels read it: contiguous, copied only
    where it is not (an expanded or sliced one); None stays None."""
    return None if t is None else t.contiguous()


@triton.jit
def load_vector(PTR, cols, D):
    """Elements ``cols`` of a contiguous vector of ``D`` (a weight, a bias), as float32; 0 past D."""
    return tl.load(PTR + cols, mask=cols < D, other=0.0).to(tl.float32)


def row_vector(d: int, *rows: tuple[torch.Tensor, int, int]) -> int:
    """How one-row-a-program kernels read ``d`` columns of rows given as ``(tensor, row stride,
    column stride)`` (tensors of one element size): ``16 // element size`` where their rows become
    aligned 16-byte vectors only after a head that differs per row (`aligned_span`), else 1 (read
    as they are).

    Triton vectorizes a row by itself when the width and the row strides are multiples of 16 and the
    bases 16-byte aligned (it specializes such arguments). A vocabulary of 50257 or 32001 has none of
    that: every element was one 2-byte access, and on an H100 softmax over 4096 × 50257 took 1.6× the
    time of 4096 × 50304 forward and 2.9× backward, cross-entropy 1.6×
    (``benchmarks/h100-2026-11-27d.md``). The aligned path needs unit column strides, 16-byte aligned
    bases and row strides equal modulo the vector (so that every row starts at the same offset within
    a vector in each tensor)."""
    if d % 16 == 0 and all(r % 16 == 0 for _, r, _ in rows):
        return 1
    vec = 16 // rows[0][0].element_size()
    first = rows[0][1]
    if vec < 2 or any(c != 1 or t.element_size() * vec != 16 or (r - first) % vec or t.data_ptr() % 16
                      for t, r, c in rows):
        return 1
    return vec


@triton.jit
def aligned_span(start, lo, hi, VEC: tl.constexpr):
    """``(a, n)``: the ``n`` columns from ``a`` on, within ``[lo, hi)``, that fill whole ``VEC``-element
    vectors of a row whose column 0 is element ``start`` of a 16-byte aligned base (`row_vector`);
    fewer than ``VEC`` columns lie on each side (`edge_columns`). ``(lo, hi − lo)`` for ``VEC`` 1."""
    if VEC > 1:
        a = tl.minimum(hi, lo + (VEC - (start + lo) % VEC) % VEC)
        n = tl.multiple_of(tl.maximum(a, hi - (start + hi) % VEC) - a, VEC)
    else:
        a, n = lo, hi - lo
    return a, n


@triton.jit
def aligned(start, col, stride, VEC: tl.constexpr):
    """``start + col · stride``, declared a multiple of ``VEC`` to the compiler where ``VEC`` > 1 (the
    offset of `aligned_span`'s column ``a``); undeclared for 1, where a hint would erase what Triton
    knows (a multiple of 16)."""
    offset = start + col * stride
    if VEC > 1:
        offset = tl.multiple_of(offset, VEC)
    return offset


@triton.jit
def edge_columns(lo, a, n, hi, VEC: tl.constexpr):
    """The columns ``[lo, a)`` and ``[a + n, hi)`` around `aligned_span`'s as one ``2·VEC``-wide tile:
    ``(cols, mask)``."""
    e = tl.arange(0, 2 * VEC)
    head = e < VEC
    cols = tl.where(head, lo + e, a + n + e - VEC)
    return cols, cols < tl.where(head, a, hi)


@triton.jit
def tile_of(pid, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows (int64), columns and mask of tile ``pid`` of an ``[R, D]`` matrix, columns fastest."""
    col_blocks = tl.cdiv(D, BLOCK_D)
    rows = ((pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (pid % col_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
    return rows, cols, (rows < R)[:, None] & (cols < D)[None, :]


def tiles(r: int, d: int, block_r: int, block_d: int) -> int:
    """How many `tile_of` tiles cover an ``[r, d]`` matrix."""
    return cdiv(r, block_r) * cdiv(d, block_d)


@triton.jit
def store_output(PTRS, value, mask, STREAM: tl.constexpr):
    """Store an output tile; with ``STREAM`` as streamed data (written once and not read back
    soon: ``.cs``, evict first), which keeps the cache for the inputs still being read."""
    if STREAM:
        tl.store(PTRS, value, mask=mask, cache_modifier=".cs")
    else:
        tl.store(PTRS, value, mask=mask)
