"""Vendor-native cross-entropy: the forward with its gradient reads each row of logits once.

The portable kernel (``kpt_triton.cross_entropy``) reads a row twice, once for its logsumexp and
once for the gradient, and relies on the L2 cache for the second read; at 128K-wide rows that
cache holds too few of them. `kpt_cuda.onchip`'s CUDA C kernel keeps the whole row on chip
instead, so the forward with its gradient moves the minimum: the logits read once, the gradient
written once.

It runs where it can: where `kpt_cuda.onchip` runs and takes the logits, a gradient wanted, at
least `ONCHIP_MIN_V` classes (narrower rows stay in L2, where the portable kernel is as fast), and at
least as many rows as multiprocessors (fewer rows leave most of the GPU idle with one block per
row: the portable kernel cuts them into spans).
Every other call, and the backward (an in-place scaling), runs the portable kernels.
"""

from __future__ import annotations

import torch

from kpt_triton import cross_entropy as portable

from . import onchip

available = onchip.available


ONCHIP_MIN_V = 32000
"""The narrowest rows held on chip. On an H100 (bf16, 2^30 logits, forward with the gradient) the
CUDA C kernel took 1.54 ms at V = 32000 against 1.74 for the portable one, but 2.00 against 1.80 at
V = 16384: narrower rows stay in L2 between the portable kernel's two reads, and one block per
multiprocessor leaves most of its threads idle."""


def cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad, *,
                      block_v: int = 8192, elems_per_warp: int = 512,
                      programs_per_sm: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, dlogits)`` like the portable `kpt_triton.cross_entropy.cross_entropy_fwd`, whose
    tuning keywords it passes on when it hands a call over."""
    split = onchip.split_for(logits, ONCHIP_MIN_V) if needs_grad else None
    if split is None:
        return portable.cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad,
                                          block_v=block_v, elems_per_warp=elems_per_warp,
                                          programs_per_sm=programs_per_sm)
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    unit = portable.unit_grad(target, ignore_index, reduction)
    onchip.launch(logits, dlogits, split, target=target.contiguous(), grad=unit, losses=losses,
                  ignore_index=ignore_index, label_smoothing=label_smoothing)
    return portable.reduce_losses(losses, target, ignore_index, reduction, torch.float32), dlogits


cross_entropy_bwd = portable.cross_entropy_bwd
