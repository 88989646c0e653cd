"""Rows held on chip: the CUDA C kernels (``onchip.cu``) that read each row once, for softmax and cross-entropy.

The portable kernels (``kpt_triton.softmax``, ``kpt_triton.cross_entropy``) read a row longer than
they can keep in registers twice, once for its log-sum-exp and once for the output, and rely on
the L2 cache for the second read; at 50K–150K-wide rows that cache holds too few of them. The
kernels in ``onchip.cu`` keep the whole row in one multiprocessor's shared memory and registers
instead, so they move the minimum: the row read once, the output written once. `launch` writes the
softmax of each row, or with a target the cross-entropy loss and its gradient; `softmax_backward`
holds a row of the softmax's output and reads its gradient past it twice.

It runs where CuPy is installed and a CUDA GPU is present (`available`), on rows of 16- or 32-bit
floats that `onchip_split` accepts: contiguous columns, a 16-byte aligned base, a row stride equal
to the width modulo a 16-byte vector (the output is contiguous, and its rows must start where the
input's do modulo a vector), and small enough to fit on chip (`launch`, with ``spill``: up to twice
that, the rest read again from L2). Rows whose width is not a whole number of vectors (GPT-2's
50257) are read as a head, whole vectors and a tail. Which calls go here is each kernel's choice
(`kpt_cuda.softmax`, `kpt_cuda.cross_entropy`).
"""

from __future__ import annotations

import functools
import warnings
from importlib import resources
from typing import Any

import torch

from kpt_triton.tiling import persistent_programs

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


def onchip_split(rows: torch.Tensor, smem_bytes: int, *alike: torch.Tensor,
                 spill: bool = False) -> tuple[int, int, int] | None:
    """``(register vectors, shared-memory vectors, spilled vectors)`` per thread when a row of the
    2-D ``rows`` fits on chip with ``smem_bytes`` of shared memory per block and the kernel can read
    it, and the tensors ``alike`` that it reads beside it have its shape and dtype and can be read
    alike; else None. With ``spill`` (the forward kernel, `launch`), a row up to twice what fits
    keeps the rest off chip, read a second time from L2 (`SPILL_VECS` in ``onchip.cu``)."""
    if rows.dtype not in _KIND or rows.dim() != 2 or 0 in rows.shape:
        return None
    per_vec = 16 // rows.element_size()
    n, v = rows.shape
    for t in (rows, *alike):
        # the output is contiguous: its rows must start where the input's rows do, modulo a vector
        if (t.shape, t.dtype) != (rows.shape, rows.dtype) or t.stride(1) != 1 or \
                (n > 1 and (t.stride(0) - v) % per_vec) or t.data_ptr() % 16:
            return None
    vecs = -(-(v // per_vec) // THREADS)  # whole vectors of a row, at most v // per_vec
    smem_vecs = min(vecs, (smem_bytes - _SCRATCH_BYTES) // (16 * THREADS))
    reg_vecs = vecs - smem_vecs
    if reg_vecs <= MAX_REG_VECS:
        return reg_vecs, smem_vecs, 0
    spilled = reg_vecs - MAX_REG_VECS
    return (MAX_REG_VECS, smem_vecs, spilled) if spill and spilled <= MAX_REG_VECS + smem_vecs else None


MIN_ROWS_PER_SM = 1
"""The fewest rows held on chip, per multiprocessor: the kernel gives each row one block, so fewer
rows leave multiprocessors idle, where the portable kernels cut each row into spans (one token:
4.3 µs of GPU time for a 128256-wide cross-entropy forward on an H100,
`benchmarks/h100-2026-11-27.md`)."""


def split_for(rows: torch.Tensor, min_width: int, *alike: torch.Tensor,
              spill: bool = False) -> tuple[int, int, int] | None:
    """`onchip_split` of ``rows`` (and ``alike``, with ``spill``) on its device, for a call with at
    least ``min_width`` columns and `MIN_ROWS_PER_SM` rows per multiprocessor; else None."""
    if not rows.is_cuda or rows.dim() != 2 or rows.shape[1] < min_width:
        return None
    props = torch.cuda.get_device_properties(rows.device)
    if rows.shape[0] < MIN_ROWS_PER_SM * props.multi_processor_count:
        return None
    # torch's stubs lack this property of CUDA builds (torch.cuda reads it too)
    return onchip_split(rows, props.shared_memory_per_block_optin, *alike, spill=spill)  # type: ignore[attr-defined]


@functools.cache
def _kernel(name: str, smem_vecs: int, device_index: int) -> Any:
    """The kernel instance ``name`` of ``onchip.cu``, compiled for one device."""
    import cupy

    source = resources.files(__package__).joinpath("onchip.cu").read_text()
    with cupy.cuda.Device(device_index):
        kernel = cupy.RawModule(code=source, options=("-std=c++17",), name_expressions=(name,)).get_function(name)
        kernel.max_dynamic_shared_size_bytes = smem_vecs * THREADS * 16
    return kernel


def _instance(kernel: str, rows: torch.Tensor, split: tuple[int, ...], *flags: bool) -> Any:
    """``kernel`` compiled for ``rows`` (2-D) held with ``split`` (its template's counts); rows of
    whole 16-byte vectors compile without the head-and-tail code (5-10% faster at 32K columns)."""
    n, v = rows.shape
    per_vec = 16 // rows.element_size()
    edges = bool(v % per_vec or (n > 1 and rows.stride(0) % per_vec))
    args = ", ".join(str(a).lower() for a in (_KIND[rows.dtype], THREADS, *split, *flags, edges))
    return _kernel(f"{kernel}<{args}>", split[1], rows.device.index)  # a CUDA tensor's device names its index


def _run(kernel: Any, rows: torch.Tensor, split: tuple[int, ...], *args: Any) -> None:
    """Launch ``kernel`` on the current stream: one block of `THREADS` per row, at most one per
    multiprocessor."""
    # CuPy and the numpy it depends on are optional: imported only where the kernel runs
    import cupy

    index = rows.device.index
    with warnings.catch_warnings():
        # CuPy 14 deprecates ExternalStream for Stream.from_external, which CuPy 13 lacks
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(rows.device).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        kernel((persistent_programs(rows.shape[0], rows.device, 1),), (THREADS,), args,
               shared_mem=split[1] * THREADS * 16)


def launch(rows: torch.Tensor, out: torch.Tensor, split: tuple[int, int, int], *, target: torch.Tensor | None = None,
           grad: torch.Tensor | None = None, losses: torch.Tensor | None = None, ignore_index: int = -100,
           label_smoothing: float = 0.0) -> None:
    """Write the softmax of each row of ``rows`` (2-D, accepted by `onchip_split` with ``split``)
    into the contiguous ``out`` of its shape; given a ``target`` (int64, one per row), ``grad``
    (one float32: the gradient reaching each row's loss) and ``losses`` (float32, one per row),
    write each row's cross-entropy loss there and its gradient into ``out`` instead."""
    import numpy as np

    n, v = rows.shape
    kernel = _instance("row_onchip", rows, split, label_smoothing > 0, target is not None)
    address = [np.uint64(t.data_ptr() if t is not None else 0) for t in (target, grad, losses)]
    _run(kernel, rows, split, np.uint64(rows.data_ptr()), *address, np.uint64(out.data_ptr()), np.int64(n),
         np.int64(rows.stride(0)), np.int64(ignore_index), np.int32(v), np.float32(label_smoothing))


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, split: tuple[int, int, int]) -> None:
    """Write ``y * (dy - sum(y * dy))`` of each row into the contiguous ``dx``: the softmax's input
    gradient, from its output ``y`` and output gradient ``dy`` (2-D, accepted by `split_for` with
    ``split``)."""
    import numpy as np

    n, v = y.shape
    if split[2]:
        raise ValueError(f"softmax_backward holds a whole row on chip: {split[2]} vectors a thread spilled")
    _run(_instance("softmax_bwd_onchip", y, split[:2]), y, split, np.uint64(y.data_ptr()), np.uint64(dy.data_ptr()),
         np.uint64(dx.data_ptr()), np.int64(n), np.int64(y.stride(0)), np.int64(dy.stride(0)), np.int32(v))
