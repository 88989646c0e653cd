"""Vendor-native attention on Hopper: NVIDIA's fused kernels (cuDNN, FlashAttention-2) through PyTorch.

On an H100 the portable Triton kernel (``kpt_triton.attention``) reaches about half of cuDNN's
forward rate and a fifth of its backward's (B4 H32 S4096 D128 bf16 causal: 276 against 558
TFLOP/s, 13.9 against 3.0 ms; ``benchmarks/``). Until kpt has a Hopper kernel of its own (wgmma,
TMA, warp specialization), kpt-cuda calls the fastest kernels PyTorch ships, forward and backward,
through the ATen operators that ``F.scaled_dot_product_attention`` dispatches to, and keeps kpt's
contract:

* ``Sq == Skv``: cuDNN. Its causal mask is aligned top-left, which equals kpt's bottom-right
  alignment only when the query and key lengths agree.
* One query (decode): cuDNN, non-causal, since that query sees every key (faster than
  FlashAttention-2 against a long cache: 64 against 73 µs at B1 H32/8 Skv32768 on an H100).
* a few queries against a KV cache (speculative decode: up to 128 query rows per KV head, the
  query heads of one KV head × Sq, `kpt_triton.attention.decodes`): kpt-triton's decode kernel,
  which reads each key once per KV head and splits a long cache over the multiprocessors (B8
  H32/8 Sq8 Skv8192: 106 µs, where cuDNN with kpt's mask took 326; B1 H32/8 Sq8 Skv32768: 56
  against FlashAttention-2's 132; B8 H32/4 Sq16 Skv8192, 128 rows: 97 against 334). For one query
  cuDNN stays level or slightly ahead of it (51.8 against 52.0–52.9 µs at B1 H32/8 Skv32768).
* other lengths (chunked prefill): cuDNN where the queries fill every multiprocessor with tiles of
  `CUDNN_QUERY_TILE`, causal ones with kpt's mask passed as an additive bias; a causal call whose
  mask is too large to cache runs the portable kernel where the arch's tuning gives it Hopper tiles
  and its query tiles fill `PORTABLE_WAVES` waves (on an H200, 128 × 128 tiles in 8 warps: 1.14 to
  1.38× FlashAttention-2 at 512 to 4096 such tiles, 0.98× at 256); otherwise FlashAttention-2,
  whose causal mask is aligned bottom-right like kpt's and which splits a long KV length for a
  short query.
* The backward is cuDNN's for equal lengths (up to `CUDNN_MAX_BACKWARD_HEAD_DIM`; cuDNN refuses a
  single query and key) and FlashAttention-2's otherwise; both read the forward's ``(o, lse)``,
  whichever kernel computed them.

Both return the softmax statistics kpt's backward contract wants (``lse``, natural log, float32).
Everything else runs the portable kernels: float32, head dimensions that are not a multiple of 8,
a zero ``scale`` (where the fused kernels return NaN), queries that see no key (causal with
``Sq > Skv``, or ``Skv == 0``), empty tensors, GPUs other than Hopper (`available`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

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

_aten = torch.ops.aten


def available() -> bool:
    """A Hopper GPU (sm90) and a torch with the fused attention operators."""
    return (device.status()[0] and device.capability()[0] == 9
            and hasattr(_aten, "_scaled_dot_product_cudnn_attention")
            and hasattr(_aten, "_scaled_dot_product_flash_attention"))


def _library(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, backward: bool = False,
             decode: portable.Decode = portable.PORTABLE_DECODE,
             tiles: portable.TilesByHeadDim | None = None) -> str | None:
    """"cudnn", "cudnn-mask" (cuDNN with kpt's causal mask as an additive bias), "flash", or None
    where the portable kernels run the call (its decode kernel with the plan ``decode`` among them,
    its forward with the arch's ``tiles``)."""
    b, hq, sq, d = q.shape
    skv = k.shape[2]
    if (q.dtype not in DTYPES or d % 8 or d > MAX_HEAD_DIM or q.numel() == 0 or skv == 0
            or (causal and sq > skv) or scale == 0.0):
        return None
    if backward:
        return "cudnn" if sq == skv > 1 and d <= CUDNN_MAX_BACKWARD_HEAD_DIM else "flash"
    if sq == skv or sq == 1:
        return "cudnn"
    if portable.decodes(q, k, tiles, plan=decode):
        return None
    # cuDNN does not split the keys of a short query: it wins only with query tiles for every SM
    if b * hq * -(-sq // CUDNN_QUERY_TILE) < _multiprocessors(q.device):
        return "flash"
    if not causal:
        return "cudnn"
    if skv % 8 == 0 and sq * _band_width(skv) <= MAX_MASK_ELEMENTS:
        return "cudnn-mask"
    hopper = (tiles or {}).get(max(16, next_pow2(d)))
    if hopper is not None and b * hq * -(-sq // hopper.block_m) >= PORTABLE_WAVES * _multiprocessors(q.device):
        return None
    return "flash"


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


def _fused_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the fused kernels read it: the last dimension contiguous, the data and every other
    stride 16-byte aligned; else a contiguous copy. (A view at an odd storage offset made cuDNN and
    FlashAttention-2 fault with "misaligned address" on an H100, which ends the CUDA context.)"""
    b, h, s, d = t.stride()
    # the vector (8 or 4 elements) is a power of two: the strides are all its multiples when their OR is
    if d == 1 and t.data_ptr() % 16 == 0 and (b | h | s) % (16 // t.element_size()) == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def attention_fwd(q, k, v, causal, scale, *, decode: portable.Decode = portable.PORTABLE_DECODE,
                  tiles: portable.TilesByHeadDim | None = None, **tuning: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` like the portable `kpt_triton.attention.attention_fwd`, whose tuning keywords
    (the decode kernel's plan and the forward's tiles among them, `kpt_cuda.tuning`) it passes on
    when it hands a call over."""
    library = _library(q, k, causal, scale, decode=decode, tiles=tiles)
    if library is None:
        return portable.attention_fwd(q, k, v, causal, scale, decode=decode, tiles=tiles, **tuning)
    causal = causal and q.shape[2] > 1
    q, k, v = (_fused_layout(t) for t in (q, k, v))
    if library == "cudnn":
        o, lse = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    elif library == "cudnn-mask":
        o, lse = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, _causal_mask(q, k.shape[2]), True, 0.0, False, False, scale=scale)[:2]
    else:
        o, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return o.contiguous(), lse.reshape(q.shape[:3]).contiguous()


def attention_bwd(q, k, v, causal, scale, o, lse, do, **tuning: Any
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like the portable `kpt_triton.attention.attention_bwd`, from the forward's
    ``(o, lse)``. No dropout, no sequence offsets: the random-state arguments are placeholders the
    fused kernels do not read, the offsets undefined (an empty tensor would mean a varlen batch)."""
    library = _library(q, k, causal, scale, backward=True)
    if library is None or do is None:
        return portable.attention_bwd(q, k, v, causal, scale, o, lse, do, **tuning)
    sq, skv = q.shape[2], k.shape[2]
    causal = causal and sq > 1
    q, k, v = (_fused_layout(t) for t in (q, k, v))
    o, do = (_fused_layout(t.contiguous()) for t in (o, do))  # the backward takes o and dO contiguous
    lse = lse.contiguous()
    unused = torch.empty((), dtype=torch.int64, device=q.device)
    if library == "cudnn":
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse.unsqueeze(-1), unused, unused, None, None, None, sq, skv, 0.0, causal, scale=scale)
    else:
        grads = _aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, None, None, sq, skv, 0.0, causal, unused, unused, scale=scale)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]
