"""Tuning tables per Intel GPU architecture: keyword arguments bound into the kpt_triton launchers.

A table (`kpt_triton.backend.Table`) lists only what differs from the launchers' portable
defaults. What differs on Intel GPUs:

* sub-groups (Triton's warps) are 16 or 32 lanes wide. Intel's Triton backend compiles a kernel
  without a dot at its default sub-group size, 32, since kpt-triton's launchers pass none
  (``warp_size``); the row and element-wise kernels size ``num_warps`` from ``elems_per_warp``,
  16 elements per lane (two 16-byte loads of 16-bit data), so ``16 * 32`` on every arch here.
  Kernels whose dots run on the matrix engines (DPAS: attention) are compiled at 16 lanes on
  Xe-HPC and Xe2, so their ``num_warps`` count 16-lane sub-groups: 8 of them for 128 queries;
* whole rows up to 4096 columns per program on the parts with a large register file;
* ``grf_mode="large"``: 256 registers a hardware thread instead of 128 (at half the threads),
  for the flash-attention kernels on Xe-HPC and Xe2, whose accumulators otherwise spill. It is
  a compiler option of Intel's Triton backend only, passed where the launcher takes compiler
  options (`kpt_triton.attention.Tiles`); Triton's interpreter ignores it;
* shared local memory (SLM, Triton's shared memory) per work-group: 128 KiB on Xe-HPC and
  Xe2, 64 KiB on Xe-HPG (`SLM_BYTES`); the attention tiles keep their pipelined key and value
  tiles within it;
* float8: none of these GPUs multiplies float8, so ``fp8_linear`` dequantizes both operands in
  a Triton kernel and runs one GEMM (the portable default; ``scaled_mm`` stays off), and the
  float8 bits are encoded in software (``native_cast`` off): the contract's answer everywhere.

None of these values has been timed, or compiled, on Intel hardware yet: they are starting
points. Upstream Triton has no Intel target, so ``kpt_triton.aot`` cannot compile them.
"""

from __future__ import annotations

from kpt_triton.attention import Tiles
from kpt_triton.backend import Table, tuning_parameters

ARCHS = {
    "pvc": "Data Center GPU Max (Ponte Vecchio, Xe-HPC)",
    "bmg": "Arc B-series (Battlemage, Xe2-HPG)",
    "lnl": "Core Ultra 200V / Arc 130V, 140V (Lunar Lake, Xe2-LPG)",
    "acm": "Arc A-series and Data Center GPU Flex (Alchemist, Xe-HPG)",
}
"""The arch tags (`kpt_xpu.device`) and what they name."""

SLM_BYTES = {"pvc": 128 << 10, "bmg": 128 << 10, "lnl": 128 << 10, "acm": 64 << 10}
"""Shared local memory one work-group may use."""

ROW_SUBGROUP = 32
"""The sub-group size of kernels without a dot (Intel's Triton backend's default)."""


def _rows(tile_elems: int) -> Table:
    """Every launcher's ``elems_per_warp`` (16 elements per lane) and ``tile_elems``."""
    values = {"elems_per_warp": 16 * ROW_SUBGROUP, "tile_elems": tile_elems}
    table = {launcher: {k: v for k, v in values.items() if k in params}
             for launcher, params in tuning_parameters().items()}
    return {launcher: entry for launcher, entry in table.items() if entry}


_LARGE = {"grf_mode": "large"}

_XE_ATTENTION = {
    "fwd": {16: Tiles(128, 64, 8, 2, _LARGE), 32: Tiles(128, 64, 8, 2, _LARGE), 64: Tiles(128, 64, 8, 2, _LARGE),
            128: Tiles(128, 64, 8, 2, _LARGE), 256: Tiles(64, 32, 8, 1, _LARGE)},
    "bwd": {16: Tiles(64, 64, 8, 2, _LARGE), 32: Tiles(64, 64, 8, 2, _LARGE), 64: Tiles(64, 64, 8, 2, _LARGE),
            128: Tiles(32, 64, 8, 2, _LARGE), 256: Tiles(32, 32, 4, 1, _LARGE)},
}
"""Xe-HPC and Xe2: 128 queries a tile in 8 sub-groups of 16 (the DPAS width), large GRF."""

XE: Table = {**_rows(4096), "attention_fwd": {"tiles": _XE_ATTENTION["fwd"]},
             "attention_bwd": {"tiles": _XE_ATTENTION["bwd"]}}
"""Data Center GPU Max, Arc B-series and Lunar Lake."""

_XE_HPG_ATTENTION = {
    "fwd": {16: Tiles(64, 64, 4, 2), 32: Tiles(64, 64, 4, 2), 64: Tiles(64, 64, 4, 2), 128: Tiles(64, 32, 4, 1),
            256: Tiles(32, 32, 4, 1)},
    "bwd": {16: Tiles(32, 32, 4, 2), 32: Tiles(32, 32, 4, 2), 64: Tiles(32, 32, 4, 2), 128: Tiles(16, 32, 4, 1),
            256: Tiles(16, 16, 4, 1)},
}
"""Xe-HPG: half the SLM, and no large register file assumed: smaller tiles, one stage from head
dim 128."""

XE_HPG: Table = {**_rows(2048), "attention_fwd": {"tiles": _XE_HPG_ATTENTION["fwd"]},
                 "attention_bwd": {"tiles": _XE_HPG_ATTENTION["bwd"]}}
"""Arc A-series and Data Center GPU Flex."""

TABLES: dict[str, Table] = {"pvc": XE, "bmg": XE, "lnl": XE, "acm": XE_HPG}
"""By `kpt_xpu.device.arch_of` tag (and ``$KPT_XPU_ARCH`` under the interpreter)."""
