"""Vendor-native softmax forward: rows too long for the portable kernel's registers read once.

The portable forward (``kpt_triton.softmax``) keeps a row of up to ``max_block`` columns in
registers (32768 on Hopper, `kpt_cuda.tuning`) and reads a longer one twice, the second time
mostly from L2. `kpt_cuda.onchip`'s CUDA C kernel holds such a row in a multiprocessor's shared
memory and registers and reads it once, as torch's own softmax does for rows that fit its shared
memory. It runs where `kpt_cuda.onchip` runs and takes the rows, for a softmax over the last
dimension of a 2-D or contiguous tensor with more than ``max_block`` columns and at least one row
per multiprocessor. Every other call, and the backward, runs the portable kernels.
"""

from __future__ import annotations

import torch

from kpt_triton import softmax as portable

from . import onchip

available = onchip.available

def softmax_fwd(x: torch.Tensor, dim: int, *, max_block: int = 16384, chunk: int = 16384, tile_elems: int = 2048,
                elems_per_warp: int = 512, stream: bool = False) -> tuple[torch.Tensor]:
    """``(y,)`` like the portable `kpt_triton.softmax.softmax_fwd`, whose tuning keywords it passes
    on when it hands a call over."""
    d = x.shape[dim]
    rows = x.view(-1, d) if dim == x.dim() - 1 and d > max_block and (x.dim() == 2 or x.is_contiguous()) else None
    split = None if rows is None else onchip.split_for(rows, max_block + 1)
    if rows is None or split is None:
        return portable.softmax_fwd(x, dim, max_block=max_block, chunk=chunk, tile_elems=tile_elems,
                                    elems_per_warp=elems_per_warp, stream=stream)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    onchip.launch(rows, y, split)
    return (y.view(x.shape),)


softmax_bwd = portable.softmax_bwd
