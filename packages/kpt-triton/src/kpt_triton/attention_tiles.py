"""How the attention launches of `kpt_triton.attention` cut their work, within the shared memory
(LDS on AMD) of the GPU they run on.

A launch takes its `Tiles` from the backend's tuning table by padded head dim (16-bit inputs from
``tiles``, float32 from ``fp32_tiles``), else the portable ones; the decode kernel takes a `Decode`
plan on top of the forward's tiles. Whatever the table says, `fit` then shrinks the tiles until
`shared_bytes`, an upper bound of what Triton allocates for them, fits the device's
`shared_memory` (or refuses the call with a one-line error): a tile choice holds for every head
dim the contract accepts, not only for those compiled ahead of time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton

import kpt

from .tiling import next_pow2


class Tiles(NamedTuple):
    """How one attention launch cuts its work: ``block_m`` queries and ``block_n`` keys per tile;
    ``options``: compiler options of one vendor's Triton backend (AMD: ``waves_per_eu``,
    ``matrix_instr_nonkdim``; Intel: ``grf_mode``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    options: Mapping[str, int | str] = {}


TilesByHeadDim = Mapping[int, Tiles]
"""Tiles by padded head dim (16, 32, 64, 128, 256): a table's ``tiles`` (16-bit inputs) or
``fp32_tiles`` (float32); a head dim a table leaves out takes the portable tiles."""


class Decode(NamedTuple):
    """How the decode kernel cuts a call (`attention_fwd` runs it where `decodes`). A plan applies to
    16-bit inputs up to head dim 128; float32 and wider heads, twice the bytes a key, take
    `PORTABLE_DECODE` and at most one query tile of the forward's rows.

    - ``rows``: the most query rows of one KV head (its group's heads × Sq) the kernel takes.
    - ``block_n`` keys a step in ``num_stages`` stages (None: the forward's `Tiles`', whose compiler
      options the kernel takes too), with ``num_warps`` warps (``wide_warps`` for tiles of more than
      64 rows, None: the same; float32 takes the forward's warps); ``block_n`` halves until a tile
      holds at most ``scores`` scores (rows × keys, held in registers; a quarter as many with a
      mask, whose tile takes registers too), and further where the tile would not fit in shared memory.
    - The keys split into chunks of at least ``split_keys``, one program each, as many as fill one
      wave of ``programs_per_sm`` programs per multiprocessor (a second, partial wave would take as
      long as the first), at most `MAX_SPLITS`.

    The portable defaults were the fastest of 16 plans on an H100 under an earlier rule that took
    the ceiling of the wave; kpt-cuda's plan for the H200 was swept there (``benchmarks/``).
    """

    rows: int = 128
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int | None = None
    programs_per_sm: int = 2
    split_keys: int = 256
    scores: int = 8192
    wide_warps: int | None = None


PORTABLE_DECODE = Decode()
"""The plan of calls that a backend's tuning does not give one, and of float32 and head dims above 128."""

MAX_SPLITS = 128
"""Chunks of keys per KV head at most (the combine kernel holds one row of every chunk at once)."""

SMALLEST_SHARED = 65536
"""The shared memory (LDS) one block may use on the smallest GPU kpt targets (gfx90a, gfx942,
RDNA): the limit the tiles keep under the Triton interpreter, so that CPU runs test the tiles every
GPU can take."""


@functools.cache
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory (LDS) one program may use on ``device``; `SMALLEST_SHARED` for CPU
    tensors, which only the Triton interpreter runs."""
    if device.type == "cpu":
        return SMALLEST_SHARED
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return int(props["max_shared_mem"])


def shared_bytes(rows: int, block_m: int, block_n: int, block_d: int, num_stages: int, dtype: torch.dtype,
                 scores: bool) -> int:
    """An upper bound of the shared memory (LDS) Triton 3.6 gives an attention kernel: two tiles of
    ``rows × block_d`` streamed through the loop in ``num_stages`` buffers each (K and V in the
    forward and decode kernels), the ``block_m × block_d`` tile of queries, and with ``scores`` one
    float32 ``block_m × block_n`` tile of scores (the backward's, and the forward's in float32 or
    with a mask, convert theirs through shared memory).

    It bounds every attention specialization of the AOT check (`kpt_triton.aot`, every conformance
    case) on gfx942 and sm90, and is exact at some: the sm90 forward of 64 × 64 keys at head dim 128
    in 2 stages (bfloat16) took 81920 bytes, the gfx942 decode kernel at head dim 80 in float32
    (16 × 64 keys, 2 stages) 69632, the bound 143360."""
    need = 2 * rows * block_d * dtype.itemsize * num_stages + block_m * block_d * dtype.itemsize
    return need + (4 * block_m * block_n if scores else 0)


def _need(t: Tiles, block_d: int, dtype: torch.dtype, backward: bool, masked: bool) -> int:
    """`shared_bytes` of the kernels that take ``t``: the forward's stream ``block_n`` keys; the
    backward's dq kernel streams ``block_n`` keys, its dk/dv kernel ``block_m`` queries (and their
    gradients)."""
    rows = max(t.block_m, t.block_n) if backward else t.block_n
    scores = backward or masked or dtype == torch.float32
    return shared_bytes(rows, t.block_m, t.block_n, block_d, t.num_stages, dtype, scores)


def fit(t: Tiles, block_d: int, dtype: torch.dtype, backward: bool, masked: bool, limit: int) -> Tiles:
    """``t``, or smaller tiles whose `shared_bytes` fit ``limit``: fewer pipeline stages down to 2,
    then half the streamed rows (keys in the forward; the larger of keys and queries in the
    backward) down to 16, then one stage, then fewer queries. Raises `kpt.KernelNotSupportedError`
    where one stage of 16 × 16 tiles does not fit."""
    while _need(t, block_d, dtype, backward, masked) > limit:
        if t.num_stages > 2:
            t = t._replace(num_stages=t.num_stages - 1)
        elif backward and t.block_m > 16 and t.block_m >= t.block_n:
            t = t._replace(block_m=t.block_m // 2)
        elif t.block_n > 16:
            t = t._replace(block_n=t.block_n // 2)
        elif t.num_stages > 1:
            t = t._replace(num_stages=1)
        elif t.block_m > 16:
            t = t._replace(block_m=t.block_m // 2)
        else:
            raise kpt.KernelNotSupportedError(
                f"attention: head dim {block_d} in {dtype} needs {_need(t, block_d, dtype, backward, masked)} "
                f"bytes of shared memory at the smallest tiles (16 x 16, one stage); this GPU has {limit}")
    return t


def portable_tiles(block_d: int, dtype: torch.dtype, backward: bool) -> Tiles:
    """Tiles that, compiled for sm_90, keep the accumulators in registers at every head dim in
    16-bit inputs and up to head dim 64 in float32 (AOT check, every conformance case); `fit` keeps
    them within the shared memory of smaller GPUs.

    Float32's dots run on FMA units with twice the registers a tile (sm90, every case of the AOT
    check): forward 32 queries × 64 keys, 32 keys at head dim 16 (with a mask 64 spilled 8 bytes a
    thread; at head dim 128 32 keys spilled 864), 16 × 32 at head dim 256 (32 × 32 spilled 38824);
    backward 16 queries (32 × 64 in 8 warps spilled 16-2828 bytes at head dims 16-64), 16 keys from
    head dim 128 on, in 8 warps at 128 (16 × 32 spilled 40-152 bytes, 16 × 16 in 4 warps 52). In 16
    bits the forward at head dim 256 takes 32 keys (64 spilled 32 bytes)."""
    if dtype == torch.float32:
        if not backward:
            return Tiles(32, 32 if block_d <= 16 else 64, 8, 2) if block_d <= 128 else Tiles(16, 32, 4, 2)
        if block_d <= 64:
            return Tiles(16, 32, 4, 2)
        return Tiles(16, 16, 8 if block_d <= 128 else 4, 2)
    if not backward:
        return Tiles(64, 64, 8, 2) if block_d <= 128 else Tiles(32, 32, 8, 2)
    if block_d <= 64:
        return Tiles(32, 64, 4, 2)
    if block_d <= 128:
        return Tiles(16, 32, 4, 2)
    return Tiles(16, 16, 4, 2)


def launch_tiles(head_dim: int, dtype: torch.dtype, tiles: TilesByHeadDim | None,
                 fp32_tiles: TilesByHeadDim | None, backward: bool, masked: bool, limit: int) -> tuple[int, Tiles]:
    """The padded head dim and the tiles of one launch, fitted to ``limit`` bytes of shared memory."""
    block_d = max(16, next_pow2(head_dim))
    table = fp32_tiles if dtype == torch.float32 else tiles
    t = table[block_d] if table is not None and block_d in table else portable_tiles(block_d, dtype, backward)
    return block_d, fit(t, block_d, dtype, backward, masked, limit)


def planned(dtype: torch.dtype, block_d: int) -> bool:
    """Whether a `Decode` plan applies: 16-bit inputs up to head dim 128 (float32 and wider heads
    hold twice the bytes a key, and take the portable plan)."""
    return dtype != torch.float32 and block_d <= 128


def decode_rows(dtype: torch.dtype, block_d: int, tiles: Tiles, plan: Decode) -> int:
    """The most query rows of one KV head that the decode kernel takes."""
    return max(tiles.block_m, plan.rows) if planned(dtype, block_d) else tiles.block_m


class DecodeTiles(NamedTuple):
    """The decode kernel's tiles: ``block_m`` query rows, ``block_n`` keys a step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(rows: int, block_d: int, dtype: torch.dtype, tiles: Tiles, plan: Decode, masked: bool,
                 limit: int) -> DecodeTiles:
    """The decode kernel's tiles for ``rows`` query rows of one KV head (`Decode`), within ``limit``
    bytes of shared memory."""
    block_m = max(16, next_pow2(rows))
    plan = plan if planned(dtype, block_d) else PORTABLE_DECODE
    block_n = tiles.block_n if plan.block_n is None else plan.block_n
    # a mask's tile (its addresses and bytes) holds more registers than a tile of scores: a quarter of
    # the keys a step (head dims 16-32, 64 rows x 64 keys: sm90 732-1020 spilled bytes a thread, gfx942
    # 12-29 VGPRs; 64 x 32 none; sm90 128 rows x 64 keys: 9448 bytes)
    scores = plan.scores // 4 if masked else plan.scores
    stages = tiles.num_stages if plan.num_stages is None else plan.num_stages
    while block_n > 16 and block_m * block_n > scores:
        block_n //= 2
    # then within shared memory, shrunk in `fit`'s order (the tile keeps every row)
    scored = masked or dtype == torch.float32
    while shared_bytes(block_n, block_m, block_n, block_d, stages, dtype, scored) > limit:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif stages > 1:
            stages = 1
        else:
            raise kpt.KernelNotSupportedError(
                f"attention: decoding {rows} query rows of head dim {block_d} in {dtype} needs "
                f"{shared_bytes(16, block_m, 16, block_d, 1, dtype, scored)} bytes of shared memory at 16 keys a "
                f"step; this GPU has {limit}")
    # float32 takes the forward's warps (its dot holds twice the registers: sm90, 32 rows of head dim 64
    # in 4 warps spilled 1376 bytes a thread)
    if dtype == torch.float32:
        warps = tiles.num_warps
    else:
        warps = (plan.wide_warps or plan.num_warps) if block_m > 64 else plan.num_warps
    return DecodeTiles(block_m, block_n, warps, stages)
