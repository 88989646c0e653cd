"""Vendor-native softmax: rows too long for the portable kernel's registers held on chip.

The portable kernels (``kpt_triton.softmax``) keep a row of up to ``max_block`` columns in
registers (32768 on Hopper for the forward, 16384 for the backward, `kpt_cuda.tuning`) and read a
longer one twice, the second time mostly from L2; the backward reads both ``y`` and ``dy`` twice.
`kpt_cuda.onchip`'s CUDA C kernels hold such a row in a multiprocessor's shared memory and
registers instead: the forward reads ``x`` once (as torch's own softmax does for rows that fit its
shared memory; a row up to twice what fits, such as Gemma's 256000 words, keeps the rest off chip
and reads it again from L2), the backward reads ``y`` once and ``dy`` twice, the second time from
L2. On an H100, 4096 × 256000 bf16 took 1.67 ms forward against 2.38 for the portable kernel and
2.09 for FlagGems (`benchmarks/h100.md`). They run
where `kpt_cuda.onchip` runs and takes the rows, for a softmax over the last dimension of 2-D or
contiguous tensors with more than ``max_block`` columns (the backward: more than 32768) and at least
one row per multiprocessor. Every other call runs the portable kernels.
"""

from __future__ import annotations

import torch

from kpt_triton import softmax as portable

from . import onchip

available = onchip.available


def _rows(t: torch.Tensor, dim: int, max_block: int) -> torch.Tensor | None:
    """The 2-D rows of ``t`` for a softmax over ``dim``, where they are wider than ``max_block`` and
    ``dim`` is the last dimension of a 2-D or contiguous tensor; else None."""
    d = t.shape[dim]
    if dim == t.dim() - 1 and d > max_block and (t.dim() == 2 or t.is_contiguous()):
        return t.view(-1, d)
    return None


def softmax_fwd(x: torch.Tensor, dim: int, *, max_block: int = 16384, chunk: int = 16384, tile_elems: int = 2048,
                elems_per_warp: int = 512, stream: bool = False) -> tuple[torch.Tensor]:
    """``(y,)`` like the portable `kpt_triton.softmax.softmax_fwd`, whose tuning keywords it passes
    on when it hands a call over."""
    rows = _rows(x, dim, max_block)
    split = None if rows is None else onchip.split_for(rows, max_block + 1, spill=True)
    if rows is None or split is None:
        return portable.softmax_fwd(x, dim, max_block=max_block, chunk=chunk, tile_elems=tile_elems,
                                    elems_per_warp=elems_per_warp, stream=stream)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    onchip.launch(rows, y, split)
    return (y.view(x.shape),)


BACKWARD_MIN_WIDTH = 32769
"""The narrowest rows whose backward is held on chip. On an H100 (bf16, 4096 rows, GPU µs, L2
flushed) the CUDA C backward took 494 against the portable kernel's 600 at 50257 columns, 1338
against 1728 at 128256, but 291 against 276 at 32768 and 171 against 166 at 16400: up to 32768
columns, the portable kernel's second reads find y and dy in L2 (`benchmarks/h100-2026-11-27f.md`)."""


def softmax_bwd(x: torch.Tensor, dim: int, y: torch.Tensor, dy: torch.Tensor, *, max_block: int = 16384,
                chunk: int = 16384, tile_elems: int = 2048, elems_per_warp: int = 512,
                tile_elems_at: tuple[tuple[int, int], ...] = ()) -> tuple[torch.Tensor]:
    """``(dx,)`` like the portable `kpt_triton.softmax.softmax_bwd`, whose tuning keywords it passes
    on when it hands a call over."""
    y_rows, dy_rows = _rows(y, dim, max_block), _rows(dy, dim, max_block)
    split = None if y_rows is None or dy_rows is None else \
        onchip.split_for(y_rows, max(max_block + 1, BACKWARD_MIN_WIDTH), dy_rows)
    if y_rows is None or dy_rows is None or split is None:
        return portable.softmax_bwd(x, dim, y, dy, max_block=max_block, chunk=chunk, tile_elems=tile_elems,
                                    elems_per_warp=elems_per_warp, tile_elems_at=tile_elems_at)
    dx = torch.empty(y_rows.shape, dtype=x.dtype, device=x.device)
    onchip.softmax_backward(y_rows, dy_rows, dx, split)
    return (dx.view(x.shape),)
