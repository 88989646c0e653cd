"""Vendor-native attention on Hopper: NVIDIA's fused kernels (cuDNN, FlashAttention-2) through
PyTorch, and kpt's own warp-specialized forward.

On an H100 the portable Triton kernel (``kpt_triton.attention``) reaches about half of cuDNN's
forward rate and a fifth of its backward's (B4 H32 S4096 D128 bf16 causal: 276 against 558
TFLOP/s, 13.9 against 3.0 ms; ``benchmarks/``). kpt-cuda calls the fastest kernels PyTorch ships,
forward and backward, through the ATen operators that ``F.scaled_dot_product_attention``
dispatches to, and keeps kpt's contract; where its own Hopper forward is faster (`warp_specialized_fwd`:
Gluon, TMA, warpgroup MMA, warp specialization, a persistent grid) and the arch's tuning has a plan
for it (`WarpSpecialized`), it runs that:

* ``Sq == Skv``: kpt's warp-specialized forward at head dim `WS_HEAD_DIM` on long sequences with
  many tiles (`_warp_specialized_wins`; on an H200 1.02 to 1.15× cuDNN there), else cuDNN, whose
  causal mask is aligned top-left: kpt's bottom-right alignment when the lengths agree.
* One query (decode): cuDNN, non-causal, since that query sees every key (faster than
  FlashAttention-2 against a long cache: 64 against 73 µs at B1 H32/8 Skv32768 on an H100).
* a few queries against a KV cache (speculative decode: up to 128 query rows per KV head, the
  query heads of one KV head × Sq, `kpt_triton.attention.decodes`): kpt-triton's decode kernel,
  which reads each key once per KV head and splits a long cache over the multiprocessors (B8
  H32/8 Sq8 Skv8192: 106 µs, where cuDNN with kpt's mask took 326; B1 H32/8 Sq8 Skv32768: 56
  against FlashAttention-2's 132; B8 H32/4 Sq16 Skv8192, 128 rows: 97 against 334). For one query
  cuDNN stays level or slightly ahead of it (51.8 against 52.0–52.9 µs at B1 H32/8 Skv32768).
* other lengths (chunked prefill): causal calls at head dim `WS_HEAD_DIM` run kpt's
  warp-specialized forward where the arch's tuning has a plan for it and the call fills the GPU
  (`_warp_specialized_wins`; on an H200 1.7 to 2.4× FlashAttention-2, SDPA's best there). Otherwise
  FlashAttention-2, whose causal mask is aligned bottom-right like kpt's and which splits a long KV
  length for a short query, where the queries do not fill every multiprocessor with tiles of
  `CUDNN_QUERY_TILE`; else cuDNN, causal calls with kpt's mask as an additive bias where the mask
  is small enough to cache; else the portable kernel where the arch's tuning gives it Hopper tiles
  and its query tiles fill `PORTABLE_WAVES` waves (on an H200, 1.14 to 1.38× FlashAttention-2 at
  512 to 4096 such tiles, 0.98× at 256); else FlashAttention-2.
* The backward is cuDNN's for equal lengths (up to `CUDNN_MAX_BACKWARD_HEAD_DIM`; cuDNN refuses a
  single query and key) and FlashAttention-2's otherwise; both read the forward's ``(o, lse)``,
  whichever kernel computed them.

* A call with a ``mask`` (padding, packed documents, and the whole causal mask transformers builds
  under ``torch.compile``) at equal lengths, forward and backward: cuDNN with the mask as an
  additive bias of 0 and -inf ("cudnn-bias", `_mask_bias`; a key-padding mask, as `kpt.patch` gives
  a padded batch, is one row of bias per batch entry broadcast over the queries), the causal flag
  kept so that cuDNN skips the blocks above the diagonal. A query the mask and the causal one hide
  every key from gets the contract's result
  after it: output 0 and lse -inf (cuDNN gives NaN there), and in the backward lse 0, so that each of
  its probabilities is exp(-inf) = 0 and it passes no gradient. Other masked calls (different
  lengths, a key length that is not a multiple of 8, head dims over `CUDNN_MAX_BACKWARD_HEAD_DIM` in
  the backward) run the portable kernels. On an H100, forward and backward, 1.17 to 2.48× the portable
  kernels and about half the unmasked rate (the bias is built and read by every head;
  `benchmarks/models/h100.md`).

Both return the softmax statistics kpt's backward contract wants (``lse``, natural log, float32).
Everything else runs the portable kernels: float32, head dimensions that are not a multiple of 8, a
zero ``scale`` (where the fused kernels return NaN), queries that see no key (causal with
``Sq > Skv``, or ``Skv == 0``), empty tensors, GPUs other than Hopper (`available`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kpt.kernels.attention import visible_keys
from kpt_triton import attention as portable
from kpt_triton.tiling import next_pow2

from . import device

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
CUDNN_MAX_BACKWARD_HEAD_DIM = 128
CUDNN_QUERY_TILE = 128
"""Queries per cuDNN work tile (an estimate: what decides between cuDNN and FlashAttention-2)."""
MAX_MASK_ELEMENTS = 1 << 22
"""The largest causal mask band cached for cuDNN (8 MiB in 16 bits, `_causal_mask`); longer calls go
to the portable kernel or FlashAttention-2."""
PORTABLE_WAVES = 3
"""Waves of query tiles over the multiprocessors from which a long causal chunk runs the portable
kernel with the arch's tiles rather than FlashAttention-2."""

PORTABLE_HEAD_DIMS = (64, 128)
"""The head dims at which the portable forward with the arch's tiles was timed against
FlashAttention-2 (the rule above). An arch's tiles at other head dims only keep the compile within
its registers (head dim 256 on sm90): they route nothing away from the library."""

WS_HEAD_DIM = 128
"""The head dimension of the warp-specialized forward (at 64 it measured slower than cuDNN)."""
WS_ROWS = 64
"""Query rows per consumer warpgroup; a program's tile is two of them."""
WS_BLOCK_N = 128
"""Keys per step of the warp-specialized forward."""
LOG2E = 1.4426950408889634
# Triton 3.9 renamed the TMA copies; 3.6 has only the older names
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


class WarpSpecialized(NamedTuple):
    """A plan for the warp-specialized forward (`_attn_fwd_ws`): K/V ring slots; the registers per
    thread of the two consumer warpgroups and of the producer warp (``setmaxnreg``); the bytes of K and
    V whose heads' tiles run together (``l2_section``, `_ws_tile`); and which calls it runs
    (`_warp_specialized_wins`). A causal chunk (``Sq < Skv``) when its query tiles cover at least
    ``min_fill`` of the multiprocessors and give each at least ``min_blocks`` blocks of 128 × 128
    visible (query, key) pairs (FlashAttention-2, which splits the keys, wins with less); equal lengths
    from the ``(length, tiles)`` of ``full_from`` without a mask and of ``causal_from`` with one (cuDNN
    wins with shorter sequences or fewer tiles)."""

    stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    l2_section: int = 16 << 20
    min_fill: float = 0.5
    min_blocks: int = 40
    full_from: tuple[int, int] = (4096, 2048)
    causal_from: tuple[int, int] = (2048, 1024)


_aten = torch.ops.aten


def available() -> bool:
    """A Hopper GPU (sm90) and a torch with the fused attention operators."""
    return (device.status()[0] and device.capability()[0] == 9
            and hasattr(_aten, "_scaled_dot_product_cudnn_attention")
            and hasattr(_aten, "_scaled_dot_product_flash_attention"))


def _library(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, backward: bool = False,
             decode: portable.Decode = portable.PORTABLE_DECODE,
             tiles: portable.TilesByHeadDim | None = None,
             warp_specialized: WarpSpecialized | None = None, mask: torch.Tensor | None = None) -> str | None:
    """"cudnn", "cudnn-mask" (cuDNN with kpt's causal mask as an additive bias), "cudnn-bias" (cuDNN
    with the call's ``mask`` as one), "flash", "warp-specialized" (kpt's Hopper forward, where the
    arch's tuning gives it a ``warp_specialized`` plan), or None where the portable kernels run the
    call (its decode kernel with the plan ``decode`` among them, its forward with the arch's ``tiles``)."""
    b, hq, sq, d = q.shape
    skv = k.shape[2]
    if (q.dtype not in DTYPES or d % 8 or d > MAX_HEAD_DIM or q.numel() == 0 or skv == 0
            or (causal and sq > skv) or scale == 0.0):
        return None
    if mask is not None:
        if sq != skv or sq == 1 or skv % 8 or (backward and d > CUDNN_MAX_BACKWARD_HEAD_DIM):
            return None
        return "cudnn-bias"
    if backward:
        return "cudnn" if sq == skv > 1 and d <= CUDNN_MAX_BACKWARD_HEAD_DIM else "flash"
    if sq == 1:
        return "cudnn"
    if sq == skv:
        return "warp-specialized" if _warp_specialized_wins(q, skv, causal, warp_specialized) else "cudnn"
    if portable.decodes(q, k, tiles, plan=decode):
        return None
    if _warp_specialized_wins(q, skv, causal, warp_specialized):
        return "warp-specialized"
    # cuDNN does not split the keys of a short query: it wins only with query tiles for every SM
    if b * hq * -(-sq // CUDNN_QUERY_TILE) < _multiprocessors(q.device):
        return "flash"
    if not causal:
        return "cudnn"
    if skv % 8 == 0 and sq * _band_width(skv) <= MAX_MASK_ELEMENTS:
        return "cudnn-mask"
    padded = max(16, next_pow2(d))
    hopper = (tiles or {}).get(padded) if padded in PORTABLE_HEAD_DIMS else None
    if hopper is not None and b * hq * -(-sq // hopper.block_m) >= PORTABLE_WAVES * _multiprocessors(q.device):
        return None
    return "flash"


def _warp_specialized_wins(q: torch.Tensor, skv: int, causal: bool, plan: WarpSpecialized | None) -> bool:
    """Whether kpt's Hopper forward beats the library's kernel on this 16-bit call, by the arch's
    ``plan`` (`WarpSpecialized`; none: it does not run). On an H200: equal lengths 1.02-1.15x cuDNN
    from 2048 (causal) or 4096 (full) keys and 1024 or 2048 tiles, 0.84-0.99x below; causal chunks
    1.7-2.4x FlashAttention-2 where they fill the GPU, 0.45-0.8x with 32 tiles or 23 blocks an SM."""
    b, hq, sq, d = q.shape
    if plan is None or d != WS_HEAD_DIM:
        return False
    tiles = _ws_tiles(q)
    if sq == skv:
        length, min_tiles = plan.causal_from if causal else plan.full_from
        return sq >= length and tiles >= min_tiles
    pairs = sq * skv - sq * (sq - 1) // 2
    sms = _multiprocessors(q.device)
    return (causal and tiles >= plan.min_fill * sms
            and b * hq * pairs >= plan.min_blocks * sms * 2 * WS_ROWS * WS_BLOCK_N)


def _ws_tiles(q: torch.Tensor) -> int:
    """The warp-specialized forward's tiles for ``q`` [B, H, S, D]: 2 × `WS_ROWS` queries of a (batch, head)."""
    b, hq, sq, _ = q.shape
    return b * hq * -(-sq // (2 * WS_ROWS))


def _multiprocessors(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _band_width(skv: int) -> int:
    """The key count of the cached mask that serves ``skv`` keys: the next power of two (``skv`` is a
    positive multiple of 8, so the width is too)."""
    return 1 << (skv - 1).bit_length()


def _causal_mask(q: torch.Tensor, skv: int) -> torch.Tensor:
    """kpt's bottom-right causal mask as cuDNN's additive bias: -inf where key j is hidden from
    query i (j > i + Skv - Sq), one [Sq, Skv] matrix broadcast over batch and heads.

    A decode loop calls with one query length and a growing key length, so the mask is the last
    ``skv`` columns of a cached band ``W = _band_width(skv)`` keys wide (whose own mask hides
    j > i + W - Sq: the same keys, shifted by W - Skv); building it per call cost two launches and
    about 45 µs of host time. Rows stay W apart, 16-byte aligned. While a CUDA graph is captured
    the band is built for the call (a band made then would be filled only when the graph replays)."""
    b, h, sq, _ = q.shape
    width = _band_width(skv)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    band = (_band if capturing else _cached_band)(sq, width, q.dtype, q.device)
    return band[:, width - skv:].expand(b, h, sq, skv)


def _band(sq: int, width: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """-inf where key j of ``width`` is hidden from query i of ``sq`` (j > i + width - sq), else 0."""
    return torch.full((sq, width), float("-inf"), dtype=dtype, device=dev).triu_(width - sq + 1)


@functools.lru_cache(maxsize=8)
def _cached_band(sq: int, width: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """`_band`, kept (at most 8, each at most `MAX_MASK_ELEMENTS`) and filled before any stream
    reads it: a later call may run on another stream."""
    band = _band(sq, width, dtype, dev)
    if band.is_cuda:
        torch.cuda.current_stream(dev).synchronize()
    return band


def _compact(mask: torch.Tensor) -> torch.Tensor:
    """A boolean ``mask`` [B, H, Sq, Skv] as the contract hands it (expanded: stride 0 where it
    broadcasts) without its repeats over the batch, the heads and the queries (a key-padding mask)."""
    for dim in (0, 1, 2):
        if mask.stride(dim) == 0:
            mask = mask.narrow(dim, 0, 1)
    return mask


def _sees(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """Whether each query of a ``mask`` [B, H, Sq, Skv] (with the bottom-right causal mask, if
    ``causal``) sees a key, broadcastable to [B, H, Sq]: a query of a key-padding mask under the causal
    one sees a key iff one at or before its diagonal is seen."""
    compact = _compact(mask)
    sq, skv = mask.shape[2:]
    if not causal:
        return compact.any(-1)
    if compact.shape[2] == 1:
        seen_before = compact[:, :, 0].cumsum(-1, dtype=torch.int32) > 0  # [B | 1, H | 1, Skv]
        return seen_before[..., skv - sq:]
    return (compact & visible_keys(sq, skv, True, mask.device)).any(-1)


def _mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cuDNN's additive bias for a boolean ``mask`` [B, H, Sq, Skv]: 0 where a key is seen, -inf where
    it is hidden, in ``dtype``; made once over the dimensions the mask broadcasts over (`_compact`)
    and expanded. Rows are ``Skv`` apart: 16-byte aligned for ``Skv % 8 == 0``."""
    compact = _compact(mask)
    bias = torch.full(compact.shape, float("-inf"), dtype=dtype, device=mask.device)
    return bias.masked_fill_(compact, 0.0).expand(mask.shape)


def _fused_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the fused kernels read it: the last dimension contiguous, the data and every other
    stride 16-byte aligned; else a contiguous copy. (A view at an odd storage offset made cuDNN and
    FlashAttention-2 fault with "misaligned address" on an H100, which ends the CUDA context.)"""
    b, h, s, d = t.stride()
    # the vector (8 or 4 elements) is a power of two: the strides are all its multiples when their OR is
    if d == 1 and t.data_ptr() % 16 == 0 and (b | h | s) % (16 // t.element_size()) == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------------------
# The warp-specialized forward (Gluon: Triton's lower-level language, which exposes Hopper's TMA
# copies, mbarriers, asynchronous warpgroup MMA and warp specialization). A persistent kernel: one
# program per multiprocessor takes 128-query tiles of a (batch, head) until none is left, the first
# its own, the next from a counter in memory (`_ws_tile`: in sections of a few heads, longest causal
# rows first). A 1-warp producer streams each tile's Q and K, V through rings of `stages` slots by TMA
# (4-D descriptors over [B, H, S, D]: a block past a head's end reads zeros, a store past it is
# dropped), running ahead into the next tile; two 4-warp consumers take 64 rows each. In every step a
# consumer issues block j's scores S_j = Q K_j^T and block j-1's P V together, then runs S_j's online
# softmax while P V is on the tensor cores (FlashAttention-3's intra-warpgroup overlap). Only blocks
# that reach past the causal diagonal or the last key are masked. A tile's output leaves through its
# Q slot by a TMA store that the next tile does not wait for.


@gluon.jit
def _ws_tile(t, Hq, Sq, Skv, n_heads, sec_heads, CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t as ``(b, h, first query row, key blocks)``. The heads (batch-major) are cut into
    sections of ``sec_heads``, whose K and V fit a share of L2 together; a section's tiles run
    together, the query tiles from the last (longest causal rows) to the first, the heads fastest."""
    n_q = gl.cdiv(Sq, 2 * ROWS)
    section = t // (sec_heads * n_q)
    head0 = section * sec_heads
    n_sec = gl.minimum(sec_heads, n_heads - head0)  # the last section may be short
    within = t - head0 * n_q
    qi = within // n_sec
    bh = head0 + within - qi * n_sec
    q_row = (n_q - 1 - qi) * 2 * ROWS
    if CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(q_row + 2 * ROWS + Skv - Sq, Skv), BLOCK_N)
    else:
        n_blocks = gl.cdiv(Skv, BLOCK_N)
    return bh // Hq, bh % Hq, q_row, n_blocks


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty,
                 tile_smem, COUNTER, Hq, GROUP, Sq, Skv, n_tiles, sec_heads, CAUSAL: gl.constexpr,
                 STAGES: gl.constexpr):
    """Takes the tiles and loads them: the tile's index into its Q slot's word (for the consumers),
    Q, then its K and V blocks through the rings; past the last tile, an index of ``n_tiles``."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    n_heads = n_tiles // gl.cdiv(Sq, 2 * ROWS)
    c = 0  # K/V blocks loaded so far (ring slot and phase)
    it = 0  # tiles taken so far (Q slot and phase)
    t = gl.program_id(0)
    while t < n_tiles:
        b, h, q_row, n_blocks = _ws_tile(t, Hq, Sq, Skv, n_heads, sec_heads, CAUSAL, ROWS, BLOCK_N)
        qs = it % 2
        mbarrier.wait(q_empty.index(qs), ((it // 2) & 1) ^ 1)  # a slot's first use waits on nothing
        tile_smem.index(qs).store(gl.full([1], t, gl.int32, layout=one))
        mbarrier.expect(q_ready.index(qs), 2 * q_desc.block_type.nbytes)
        for w in gl.static_range(2):
            _tma_load(q_desc, [b, h, q_row + w * ROWS, 0], q_ready.index(qs), q_smem.index(2 * qs + w))
        for j in range(n_blocks):
            slot = c % STAGES
            free = ((c // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, h // GROUP, j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), free)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, h // GROUP, j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))
            c += 1
        it += 1
        t = gl.num_programs(0) + gl.atomic_add(COUNTER, 1)
    qs = it % 2
    mbarrier.wait(q_empty.index(qs), ((it // 2) & 1) ^ 1)
    tile_smem.index(qs).store(gl.full([1], n_tiles, gl.int32, layout=one))
    mbarrier.arrive(q_ready.index(qs), count=1)


@gluon.jit
def _ws_softmax(s, m_i, l_i, MASKED: gl.constexpr, CAUSAL: gl.constexpr, rows, cols, off, Skv, qk_scale):
    """Online softmax of one block of raw scores, the scale folded into the exponent's FMA:
    ``(p, alpha, m, l)``, m in log2 units. A masked block hides keys past the last and, causal, keys
    j > i + off."""
    if MASKED:
        keep = cols[None, :] < Skv
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + off)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _ws_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i, l_i, acc, zero_s, j, g,
             MASKED: gl.constexpr, CAUSAL: gl.constexpr, rows, offs_n, off, Skv, qk_scale, STAGES: gl.constexpr,
             p_layout: gl.constexpr, row_o: gl.constexpr):
    """Key block j (the ring's g-th): its scores are issued with block j-1's P V, then softmaxed while
    P V runs."""
    BLOCK_N: gl.constexpr = k_smem.type.shape[3]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
    slot = g % STAGES
    prev = (g - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    k = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    s = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]),
                        acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j is done; P V may still run
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, MASKED, CAUSAL, rows, j * BLOCK_N + offs_n, off, Skv, qk_scale)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(prev), count=1)
    return p, alpha, m_i, l_i, acc


@gluon.jit
def _ws_consumer(o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, tile_smem, LSE,
                 Hq, Sq, Skv, n_tiles, sec_heads, qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr,
                 STAGES: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[3]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
    BLOCK_N: gl.constexpr = k_smem.type.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    off = Skv - Sq  # bottom-right causal: query i sees keys j <= i + off
    n_heads = n_tiles // gl.cdiv(Sq, 2 * ROWS)
    c = 0
    it = 0
    mbarrier.wait(q_ready.index(0), 0)
    t = gl.max(tile_smem.index(0).load(one), axis=0)
    while t < n_tiles:
        b, h, q_row, n_blocks = _ws_tile(t, Hq, Sq, Skv, n_heads, sec_heads, CAUSAL, ROWS, BLOCK_N)
        qs = it % 2
        q_buf = q_smem.index(2 * qs + WG)
        q = q_buf.reshape([ROWS, HEAD_DIM])
        first = q_row + WG * ROWS
        rows = first + gl.arange(0, ROWS, layout=row_s)
        # the blocks whose every key every row of this warpgroup sees run unmasked
        if CAUSAL:
            n_full = gl.minimum(first + off + 1, Skv) // BLOCK_N
        else:
            n_full = Skv // BLOCK_N
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(c % STAGES).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
        if it > 0:  # the previous tile's output has been read out of its Q slot: the producer may refill it
            tma.store_wait(pendings=0)
            mbarrier.arrive(q_empty.index(1 - qs), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(k_empty.index(c % STAGES), count=1)
        # every row sees key 0 (off >= 0): the row maxima are finite from the first block on
        if n_full == 0:
            p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, True, CAUSAL, rows, offs_n, off, Skv, qk_scale)
        else:
            p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, False, CAUSAL, rows, offs_n, off, Skv, qk_scale)
        for j in range(1, n_full):
            p, alpha, m_i, l_i, acc = _ws_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i,
                                               l_i, acc, zero_s, j, c + j, False, CAUSAL, rows, offs_n, off, Skv,
                                               qk_scale, STAGES, p_layout, row_o)
        for j in range(gl.maximum(n_full, 1), n_blocks):
            p, alpha, m_i, l_i, acc = _ws_step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i,
                                               l_i, acc, zero_s, j, c + j, True, CAUSAL, rows, offs_n, off, Skv,
                                               qk_scale, STAGES, p_layout, row_o)
        c += n_blocks
        last = (c - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((c - 1) // STAGES) & 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                            v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(last), count=1)
        o = acc / gl.convert_layout(l_i, row_o)[:, None]
        gl.store(LSE + (b * Hq + h) * Sq + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < Sq)
        q.store(o.to(dtype))  # Q's slot is free: every product that read it has finished
        fence_async_shared()
        _tma_store(o_desc, [b, h, first, 0], q_buf)
        it += 1
        mbarrier.wait(q_ready.index(it % 2), (it // 2) & 1)
        t = gl.max(tile_smem.index(it % 2).load(one), axis=0)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, LSE, COUNTER, Hq, GROUP, Sq, Skv, n_tiles, sec_heads, qk_scale,
                 CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 PRODUCER_REGS: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    # two Q slots (a tile and the next) of two 64-row halves; a tile's word beside each
    q_smem = gl.allocate_shared_memory(dtype, [4, 1, 1, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)

    gl.warp_specialize([
        (_ws_consumer, (o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty,
                        tile_smem, LSE, Hq, Sq, Skv, n_tiles, sec_heads, qk_scale, 0, CAUSAL, STAGES)),
        (_ws_consumer, (o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty,
                        tile_smem, LSE, Hq, Sq, Skv, n_tiles, sec_heads, qk_scale, 1, CAUSAL, STAGES)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready,
                        q_empty, tile_smem, COUNTER, Hq, GROUP, Sq, Skv, n_tiles, sec_heads, CAUSAL, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=8)
def _smem_layout(rows: int, d: int, dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor over ``t`` [B, H, S, D] (`_fused_layout`'s alignment) in blocks of ``rows`` × D."""
    d = t.shape[3]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d], _smem_layout(rows, d, t.dtype))


def _section_heads(q: torch.Tensor, k: torch.Tensor, plan: WarpSpecialized) -> int:
    """Query heads per L2 section (`_ws_tile`): the groups whose K and V fit ``plan.l2_section`` bytes."""
    b, hq, _, _ = q.shape
    _, hkv, skv, d = k.shape
    groups = max(1, plan.l2_section // (2 * skv * d * k.element_size()))
    return min(b * hq, groups * (hq // hkv))


def warp_specialized_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                         plan: WarpSpecialized) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` from the warp-specialized forward: 16-bit [B, H, S, D] inputs laid out as `_fused_layout`
    leaves them, head dim `WS_HEAD_DIM`, a causal mask aligned bottom-right (``Sq <= Skv``)."""
    b, hq, sq, d = q.shape
    o = torch.empty((b, hq, sq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)  # tiles taken past each program's first
    n_tiles = _ws_tiles(q)
    descriptors = (_descriptor(q, WS_ROWS), _descriptor(k, WS_BLOCK_N), _descriptor(v, WS_BLOCK_N),
                   _descriptor(o, WS_ROWS))
    _attn_fwd_ws[(min(n_tiles, _multiprocessors(q.device)), )](
        *descriptors, lse, counter, hq, hq // k.shape[1], sq, k.shape[2], n_tiles, _section_heads(q, k, plan),
        scale * LOG2E, CAUSAL=causal, STAGES=plan.stages, CONSUMER_REGS=plan.consumer_regs,
        PRODUCER_REGS=plan.producer_regs, num_warps=4)
    return o, lse


def attention_fwd(q, k, v, causal, scale, mask, *, decode: portable.Decode = portable.PORTABLE_DECODE,
                  tiles: portable.TilesByHeadDim | None = None, warp_specialized: WarpSpecialized | None = None,
                  **tuning: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` like the portable `kpt_triton.attention.attention_fwd`, whose tuning keywords
    (the decode kernel's plan and the forward's tiles among them, `kpt_cuda.tuning`) it passes on
    when it hands a call over (`_library`); ``warp_specialized`` is the arch's plan for kpt's Hopper
    forward."""
    library = _library(q, k, causal, scale, decode=decode, tiles=tiles, warp_specialized=warp_specialized,
                       mask=mask)
    if library is None:
        return portable.attention_fwd(q, k, v, causal, scale, mask, decode=decode, tiles=tiles, **tuning)
    causal = causal and q.shape[2] > 1
    q, k, v = (_fused_layout(t) for t in (q, k, v))
    if library == "warp-specialized":
        assert warp_specialized is not None  # _library picks it only with the arch's plan
        return warp_specialized_fwd(q, k, v, causal, scale, warp_specialized)
    if library == "cudnn-bias":
        o, lse = _aten._scaled_dot_product_cudnn_attention(q, k, v, _mask_bias(mask, q.dtype), True, 0.0, causal,
                                                           False, scale=scale)[:2]
        o, lse = o.contiguous(), lse.reshape(q.shape[:3]).contiguous()
        sees = _sees(mask, causal)
        # a query that sees no key: cuDNN's NaN becomes the contract's zeros and -inf
        return o.masked_fill_(~sees.unsqueeze(-1), 0.0), lse.masked_fill_(~sees, float("-inf"))
    if library == "cudnn":
        o, lse = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    elif library == "cudnn-mask":
        o, lse = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, _causal_mask(q, k.shape[2]), True, 0.0, False, False, scale=scale)[:2]
    else:
        o, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return o.contiguous(), lse.reshape(q.shape[:3]).contiguous()


def attention_bwd(q, k, v, causal, scale, mask, o, lse, do, **tuning: Any
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like the portable `kpt_triton.attention.attention_bwd`, from the forward's
    ``(o, lse)``, whichever kernel computed them. No dropout, no sequence offsets: the random-state
    arguments are placeholders the fused kernels do not read, the offsets undefined (an empty tensor
    would mean a varlen batch)."""
    library = _library(q, k, causal, scale, backward=True, mask=mask)
    if library is None or do is None:
        return portable.attention_bwd(q, k, v, causal, scale, mask, o, lse, do, **tuning)
    sq, skv = q.shape[2], k.shape[2]
    causal = causal and sq > 1
    q, k, v = (_fused_layout(t) for t in (q, k, v))
    o, do = (_fused_layout(t.contiguous()) for t in (o, do))  # the backward takes o and dO contiguous
    lse = lse.contiguous()
    unused = torch.empty((), dtype=torch.int64, device=q.device)
    if library == "cudnn-bias":
        # a query that sees no key (lse -inf): lse 0 makes each of its probabilities exp(-inf - 0) = 0
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.nan_to_num(neginf=0.0).unsqueeze(-1), unused, unused, _mask_bias(mask, q.dtype),
            None, None, sq, skv, 0.0, causal, scale=scale)
    elif library == "cudnn":
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.unsqueeze(-1), unused, unused, None, None, None, sq, skv, 0.0, causal, scale=scale)
    else:
        grads = _aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, None, None, sq, skv, 0.0, causal, unused, unused, scale=scale)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]
