"""Vendor-native cross-entropy: the forward with its gradient reads each row of logits once.

The portable kernel (``kpt_triton.cross_entropy``) reads a row twice, once for its logsumexp and
once for the gradient, and relies on the L2 cache for the second read; at 128K-wide rows that
cache holds too few of them. The CUDA C kernel in ``cross_entropy.cu`` keeps the whole row on
chip instead, in one multiprocessor's shared memory and registers, so the forward with its
gradient moves the minimum: the logits read once, the gradient written once.

It runs where it can: CuPy installed and a CUDA GPU present (`available`), a gradient wanted,
logits of 16- or 32-bit floats with contiguous rows, a 16-byte aligned base, and a row stride
equal to the width modulo a 16-byte vector (rows whose width is not a whole number of vectors,
GPT-2's 50257, are read as a head, whole vectors and a tail), small enough to fit on chip
(`onchip_split`), at least
`ONCHIP_MIN_V` classes (narrower rows stay in L2, where the portable kernel is as fast), and at
least as many rows as multiprocessors (fewer rows leave most of the GPU idle with one block per
row: the portable kernel cuts them into spans).
Every other call, and the backward (an in-place scaling), runs the portable kernels.
"""

from __future__ import annotations

import functools
import warnings
from importlib import resources
from typing import Any

import torch

from kpt_triton import cross_entropy as portable
from kpt_triton.tiling import multiprocessor_count, persistent_programs

from . import device

THREADS = 1024
"""Threads per block: one block, holding one row, per multiprocessor."""

MAX_REG_VECS = 6
"""16-byte vectors of the row a thread may hold in registers, beyond its shared-memory slots."""

_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_SCRATCH_BYTES = 3 * (THREADS // 32) * 4
"""The kernel's static shared memory (its block reductions)."""


def available() -> bool:
    """CuPy imports and sees a CUDA GPU."""
    return device.cupy_version() is not None


def onchip_split(logits: torch.Tensor, smem_bytes: int) -> tuple[int, int] | None:
    """``(register vectors, shared-memory vectors)`` per thread when a row of ``logits`` fits on
    chip with ``smem_bytes`` of shared memory per block and the kernel can read it; else None."""
    if logits.dtype not in _KIND or logits.dim() != 2 or 0 in logits.shape:
        return None
    per_vec = 16 // logits.element_size()
    n, v = logits.shape
    # the gradient is contiguous: its rows must start where the logits' rows do, modulo a vector
    if (logits.stride(1) != 1 or (n > 1 and (logits.stride(0) - v) % per_vec)
            or logits.data_ptr() % 16):
        return None
    vecs = -(-(v // per_vec) // THREADS)  # whole vectors of a row, at most v // per_vec
    smem_vecs = min(vecs, (smem_bytes - _SCRATCH_BYTES) // (16 * THREADS))
    reg_vecs = vecs - smem_vecs
    return (reg_vecs, smem_vecs) if reg_vecs <= MAX_REG_VECS else None


@functools.cache
def _kernel(kind: int, reg_vecs: int, smem_vecs: int, smoothing: bool, edges: bool, device_index: int) -> Any:
    import cupy

    flags = f"{str(smoothing).lower()}, {str(edges).lower()}"
    name = f"cross_entropy_onchip<{kind}, {THREADS}, {reg_vecs}, {smem_vecs}, {flags}>"
    source = resources.files(__package__).joinpath("cross_entropy.cu").read_text()
    with cupy.cuda.Device(device_index):
        kernel = cupy.RawModule(code=source, options=("-std=c++17",), name_expressions=(name,)).get_function(name)
        kernel.max_dynamic_shared_size_bytes = smem_vecs * THREADS * 16
    return kernel


def _onchip(logits, target, unit, losses, dlogits, ignore_index, label_smoothing, split) -> None:
    # CuPy and the numpy it depends on are optional: imported only where the kernel runs
    import cupy
    import numpy as np

    reg_vecs, smem_vecs = split
    n, v = logits.shape
    index = logits.device.index  # a CUDA tensor's device always names its index
    per_vec = 16 // logits.element_size()
    # rows of whole vectors compile without the head-and-tail code (5-10% faster at 32K columns)
    edges = bool(v % per_vec or (n > 1 and logits.stride(0) % per_vec))
    kernel = _kernel(_KIND[logits.dtype], reg_vecs, smem_vecs, label_smoothing > 0, edges, index)
    with warnings.catch_warnings():
        # CuPy 14 deprecates ExternalStream for Stream.from_external, which CuPy 13 lacks
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(logits.device).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        kernel(
            (persistent_programs(n, logits.device, 1),), (THREADS,),
            (np.uint64(logits.data_ptr()), np.uint64(target.data_ptr()), np.uint64(unit.data_ptr()),
             np.uint64(losses.data_ptr()), np.uint64(dlogits.data_ptr()), np.int64(n),
             np.int64(logits.stride(0)), np.int64(ignore_index), np.int32(v),
             np.float32(label_smoothing)),
            shared_mem=smem_vecs * THREADS * 16,
        )


ONCHIP_MIN_V = 32000
"""The narrowest rows held on chip. On an H100 (bf16, 2^30 logits, forward with the gradient) the
CUDA C kernel took 1.54 ms at V = 32000 against 1.74 for the portable one, but 2.00 against 1.80 at
V = 16384: narrower rows stay in L2 between the portable kernel's two reads, and one block per
multiprocessor leaves most of its threads idle."""


ONCHIP_MIN_ROWS_PER_SM = 1
"""The fewest rows held on chip, per multiprocessor: the kernel gives each row one block, so fewer
rows leave multiprocessors idle, where the portable kernel cuts each row into spans (one token:
4.3 µs of GPU time for a 128256-wide forward on an H100, `benchmarks/h100-2026-11-27.md`)."""


def cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad, *,
                      block_v: int = 8192, elems_per_warp: int = 512,
                      programs_per_sm: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, dlogits)`` like the portable `kpt_triton.cross_entropy.cross_entropy_fwd`, whose
    tuning keywords it passes on when it hands a call over."""
    split = None
    if (needs_grad and logits.is_cuda and logits.shape[-1] >= ONCHIP_MIN_V
            and logits.shape[0] >= ONCHIP_MIN_ROWS_PER_SM * multiprocessor_count(logits.device)):
        props = torch.cuda.get_device_properties(logits.device)
        split = onchip_split(logits, props.shared_memory_per_block_optin)
    if split is None:
        return portable.cross_entropy_fwd(logits, target, ignore_index, label_smoothing, reduction, needs_grad,
                                          block_v=block_v, elems_per_warp=elems_per_warp,
                                          programs_per_sm=programs_per_sm)
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    unit = portable.unit_grad(target, ignore_index, reduction)
    _onchip(logits, target.contiguous(), unit, losses, dlogits, ignore_index, label_smoothing, split)
    return portable.reduce_losses(losses, target, ignore_index, reduction, logits.dtype), dlogits


cross_entropy_bwd = portable.cross_entropy_bwd
