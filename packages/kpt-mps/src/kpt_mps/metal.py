"""Launching kpt-mps's Metal kernels: on an Apple GPU through ``torch.mps.compile_shader``, or
through the emulator on CPU tensors when ``KPT_MPS_EMULATE=1``.

Each kernel family is one ``shaders/<family>.metal`` file, compiled with ``shaders/common.metal``
before it into one library (once per process). Kernels take untyped buffers and a dtype code per
tensor (`code`), and their scalar arguments as small int64 and float32 buffers (`ints`, `floats`),
so one library serves every dtype. Dispatches are 1-D: `rows` gives one threadgroup of
`ROW_THREADS` threads to each row; `elements` a grid-stride loop over ``n`` elements.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from typing import Any

import torch

ROW_THREADS = 256
"""Threads per threadgroup of the row kernels (8 simdgroups of 32; their reductions take any count)."""

MAX_GROUPS = 1024
"""Threadgroups of a grid-stride dispatch: each thread loops over elements beyond the first wave."""

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
"""The dtype codes of ``shaders/common.metal``'s ``load``/``store``."""


def emulated() -> bool:
    """``KPT_MPS_EMULATE=1``: every kernel runs in the Metal emulator on CPU tensors."""
    return os.environ.get("KPT_MPS_EMULATE", "0") == "1"


def source(family: str) -> str:
    """``common.metal`` followed by ``<family>.metal``: the text of one library."""
    shaders = resources.files(__package__).joinpath("shaders")
    return shaders.joinpath("common.metal").read_text() + "\n" + shaders.joinpath(f"{family}.metal").read_text()


@functools.cache
def _library(family: str, emulate: bool) -> Any:
    if emulate:
        from .emulator import Library

        return Library(source(family), f"{family}.metal")
    return torch.mps.compile_shader(source(family))


def code(t: torch.Tensor | None) -> int:
    """The dtype code of ``t`` (-1 for an absent optional tensor)."""
    return -1 if t is None else CODES[t.dtype]


def buffer(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel reads it: contiguous, float8 as bytes (MPS has no float8 tensors); an
    absent optional tensor as a one-element placeholder that the kernel never reads."""
    if t is None:
        return torch.zeros(1, dtype=torch.float32, device=like.device)
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def ints(*values: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


def floats(*values: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def launch(family: str, kernel: str, buffers: list[torch.Tensor], threads: int, group_size: int) -> None:
    """Run ``kernel`` of ``family`` over ``threads`` threads (whole threadgroups of ``group_size``)."""
    if threads == 0:
        return
    emulate = emulated()
    lib = _library(family, emulate)
    if emulate:
        lib.dispatch(kernel, buffers, threads, group_size)
    else:
        getattr(lib, kernel)(*buffers, threads=threads, group_size=group_size)


def rows(family: str, kernel: str, buffers: list[torch.Tensor], n: int) -> None:
    """One threadgroup of `ROW_THREADS` per row, ``n`` rows."""
    launch(family, kernel, buffers, n * ROW_THREADS, ROW_THREADS)


def elements(family: str, kernel: str, buffers: list[torch.Tensor], n: int) -> None:
    """Enough threads for ``n`` elements (at most `MAX_GROUPS` threadgroups; kernels loop)."""
    groups = min(-(-n // ROW_THREADS), MAX_GROUPS)
    launch(family, kernel, buffers, groups * ROW_THREADS, ROW_THREADS)
