"""Tuning tables per AMD architecture: keyword arguments bound into the kpt_triton launchers.

A table (`kpt_triton.backend.Table`) lists only what differs from the launchers' portable
defaults, which were chosen for 32-lane NVIDIA warps. What differs on AMD:

* CDNA (Instinct: gfx90a, gfx942, gfx950) runs 64-lane wavefronts, RDNA (Radeon: gfx1100,
  gfx1201) 32-lane ones. The row and element-wise kernels size ``num_warps`` from
  ``elems_per_warp``: 16 elements per lane (two 16-byte loads of 16-bit data) is
  ``16 * lanes`` per wave, so CDNA doubles the portable 512 and RDNA keeps it;
* whole rows up to 4096 columns per program (``tile_elems``), as on NVIDIA, and persistent
  backward grids of 2 programs per compute unit (a CDNA CU holds 4 SIMDs of 512 VGPRs a lane:
  two 4096-wide tiles of 4 waves fill it);
* attention: the CDNA flash tiles of AMD's own Triton kernels (128 queries × 64 keys, 4 waves,
  ``waves_per_eu`` 2, 16-wide MFMA instructions, one pipeline stage: the K and V tiles
  double-buffered would overflow the 64 KiB LDS at head dim 128); gfx950 has 160 KiB of LDS;
* float8: the contract's formats are the OCP ones (``float8_e4m3fn``, ``float8_e5m2``). gfx950
  and gfx1201 compute in them; gfx942 (MI300) computes in the FNUZ formats and gfx90a and
  gfx1100 have no float8 at all. The quantize and dequantize kernels encode and decode the OCP
  bits with integer arithmetic on every architecture (``native_cast`` stays off: exact, and the
  same bits as torch), so every arch gives the contract's answer. ``fp8_linear`` runs
  ``torch._scaled_mm`` (hipBLASLt) on gfx950 only; elsewhere it dequantizes both operands to
  float32 and multiplies them in one float32 GEMM.

None of these values has been timed on AMD hardware yet: they are the starting points, compiled
for every arch by ``python -m kpt_triton.aot --backend rocm --arch <arch>`` (registers, spills,
LDS within the limits).
"""

from __future__ import annotations

from kpt_triton.attention_tiles import Decode, Tiles
from kpt_triton.backend import Table

ROW_LAUNCHERS = ("rms_norm_fwd", "rms_norm_bwd", "add_rms_norm_fwd", "add_rms_norm_bwd", "layer_norm_fwd",
                 "layer_norm_bwd", "softmax_fwd", "softmax_bwd", "rope_fwd", "rope_bwd", "quantize_fp8_fwd")
PERSISTENT_LAUNCHERS = ("rms_norm_bwd", "add_rms_norm_bwd", "layer_norm_bwd", "quantize_fp8_fwd")
POINTWISE_LAUNCHERS = ("gelu_fwd", "gelu_bwd", "silu_fwd", "silu_bwd", "swiglu_fwd", "swiglu_bwd", "geglu_fwd",
                       "geglu_bwd", "dequantize_fp8_fwd", "fp8_linear_fwd")
VOCAB_LAUNCHERS = ("cross_entropy_fwd", "linear_cross_entropy_fwd", "linear_cross_entropy_bwd")


def _lanes(lanes: int) -> Table:
    """The entries that follow from the wavefront width: 16 elements per lane everywhere."""
    per_wave = {"elems_per_warp": 16 * lanes}
    table = {name: {"tile_elems": 4096, **per_wave} for name in ROW_LAUNCHERS}
    for name in PERSISTENT_LAUNCHERS:
        table[name] = {**table[name], "programs_per_sm": 2}
    table["quantize_fp8_fwd"]["block"] = 8192
    # 8 elements a lane where a lane keeps several float32 values per element (gfx942, AOT check:
    # layer_norm_bwd's 4 x 1024 tile 2 spills, quantize_fp8's rows of 8192 2-5 and of 1 column 2-60;
    # none at 8)
    for name in ("layer_norm_bwd", "quantize_fp8_fwd"):
        table[name]["elems_per_warp"] = 8 * lanes
    table.update({name: {"block": 8192, **per_wave} for name in POINTWISE_LAUNCHERS})
    table.update({name: {"block_v": 8192, **per_wave} for name in VOCAB_LAUNCHERS})
    return table


_CDNA_FLASH = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16}
"""AMD-only compiler options of the attention launches (`Tiles.options`)."""

_CDNA_ATTENTION = {
    "fwd": {16: Tiles(128, 64, 4, 1, _CDNA_FLASH), 32: Tiles(128, 64, 4, 1, _CDNA_FLASH),
            64: Tiles(128, 64, 8, 1, _CDNA_FLASH), 128: Tiles(128, 64, 8, 1, _CDNA_FLASH),
            256: Tiles(64, 32, 4, 1, _CDNA_FLASH)},
    "bwd": {16: Tiles(32, 64, 4, 1, _CDNA_FLASH), 32: Tiles(16, 32, 4, 1, _CDNA_FLASH),
            64: Tiles(32, 64, 4, 1, _CDNA_FLASH), 128: Tiles(32, 32, 4, 1, _CDNA_FLASH),
            256: Tiles(16, 16, 4, 1, _CDNA_FLASH)},
    "fwd_fp32": {16: Tiles(32, 32, 4, 1), 32: Tiles(32, 32, 4, 1), 64: Tiles(16, 32, 4, 1),
                 128: Tiles(32, 32, 4, 1), 256: Tiles(16, 16, 4, 1)},
    "bwd_fp32": {d: Tiles(16, 32, 4, 1) for d in (16, 32, 64, 128)} | {256: Tiles(16, 16, 4, 1)},
}
"""In the AOT check on gfx942 (every conformance case): 8 waves at head dim 64 forward (4 spilled 4-6
VGPRs with the causal mask), 32 queries backward up to head dim 64 (64 spilled 7-41 with a mask) and
16 x 32 at head dim 32 (32 x 64 spilled 9-13 with a mask, 32 x 32 7-10), 16 x 16 at head dim 256 (16 x 32 spilled 31).
Float32's dots run on FMA units, within 256 VGPRs a lane: 4 waves (8, the portable tiles', halve the
registers of a lane: 2-564 spills), 32 keys forward and 16 queries at head dim 64 (32 spilled 17 with
a mask), 16 queries backward (32 spilled 26-54 with a mask); 16 x 16 at head dim 256 forward, what `fit`
makes of 32 x 32 in gfx942's LDS (gfx950's 160 KiB kept 32 x 32, which spilled 4 VGPRs with the causal mask)."""

_DISPATCH = {"moe_dispatch_fwd": {"block_pairs": 32, "block_e": 32, "block_h": 128}}
"""The dispatch's [pairs x experts] and [pairs x pairs] compares at the portable 128 x 128 spill on
every AMD target (52-88 spills in the AOT check), and at 64 pairs on gfx942 (4-20); 32 pairs and 32
experts a step do not."""

CDNA: Table = {
    **_lanes(64),
    **_DISPATCH,
    "attention_fwd": {"tiles": _CDNA_ATTENTION["fwd"], "fp32_tiles": _CDNA_ATTENTION["fwd_fp32"]},
    "attention_bwd": {"tiles": _CDNA_ATTENTION["bwd"], "fp32_tiles": _CDNA_ATTENTION["bwd_fp32"]},
}
"""Instinct MI300X/MI325X (gfx942), and the base of gfx90a's and gfx950's: no OCP float8 in hardware."""

GFX90A: Table = {
    **CDNA,
    "attention_fwd": {**CDNA["attention_fwd"], "fp32_tiles": {**_CDNA_ATTENTION["fwd_fp32"], 32: Tiles(16, 32, 4, 1)},
                      "decode": Decode(scores=2048)},
    "quantize_fp8_fwd": {**CDNA["quantize_fp8_fwd"], "elems_per_warp": 4 * 64},
}
"""MI210/MI250X: CDNA, with what gfx90a's compiler spilled at CDNA's tiles in the AOT check (every case, none
after): float32's forward at head dim 32 with a mask (32 x 32: 4 VGPRs; 16 x 32 as at head dim 64), the masked
decode kernel at head dim 64 in 16 bits (16 rows x 64 keys: 2; half the scores a tile, so 32 keys), and
quantize_fp8's rows of one column (4096 x 1 tiles, 8 elements a lane: 4; 4 a lane)."""

GFX950: Table = {**CDNA, "fp8_linear_fwd": {**CDNA["fp8_linear_fwd"], "scaled_mm": True}}
"""Instinct MI355X: CDNA with OCP float8 matrix cores (and 160 KiB of LDS)."""

_RDNA_ATTENTION = {
    "fwd": {16: Tiles(64, 64, 4, 1), 32: Tiles(64, 64, 4, 1), 64: Tiles(64, 64, 4, 1), 128: Tiles(64, 32, 4, 1),
            256: Tiles(16, 16, 16, 1)},
    "bwd": {16: Tiles(32, 32, 4, 1), 32: Tiles(32, 32, 4, 1), 64: Tiles(32, 32, 4, 1), 128: Tiles(16, 16, 4, 1),
            256: Tiles(16, 16, 4, 1)},
    "fwd_fp32": {16: Tiles(16, 32, 8, 1), 32: Tiles(16, 32, 8, 1), 64: Tiles(16, 16, 8, 1), 128: Tiles(16, 16, 8, 1),
                 256: Tiles(16, 16, 8, 1)},
}
"""RDNA has no asynchronous copies to pipeline (one stage) and, at head dim 128, half the
portable key tile: the portable tiles spilled 11-477 registers in the AOT check. A 32-lane wave
has 256 VGPRs a lane, half a CDNA lane's with its AGPRs, so the tiles hold half as much a lane
(gfx1100, AOT check at every case): head dim 256 forward in 16 x 16 and 16 waves (32 x 32 in 4
spilled 114-125 VGPRs with the causal mask, 16 x 16 in 4 66-96); float32's forward in 8 waves of
16 queries, 32 keys up to head dim 32 and 16 from 64 (the portable 32 x 64 and 32 x 32 in 8 spilled
33-319, 16 x 32 at head dim 128 241). Float32 at head dim 256 spills at the smallest tile (16 x 16:
562, 156 and 163 VGPRs in 4, 8 and 16 waves): accepted in `SPILLS` with 8."""

_RDNA_DECODE = Decode(num_warps=8, scores=2048)
"""The decode kernel in 8 waves and at most 2048 scores a tile (512 with a mask): in 4 waves of 32
lanes 128 rows x 64 keys spilled 88-128 VGPRs on gfx1100 and 64 x 64 3-9; in 8, 128 x 64 spilled none
but masked tiles did from 1024 scores (16 x 64: 1, 64 x 32: 4, 64 x 64: 30-102)."""

RDNA: Table = {
    **_lanes(32),
    **_DISPATCH,
    "attention_fwd": {"tiles": _RDNA_ATTENTION["fwd"], "fp32_tiles": _RDNA_ATTENTION["fwd_fp32"],
                      "decode": _RDNA_DECODE},
    "attention_bwd": {"tiles": _RDNA_ATTENTION["bwd"]},
    # an order of 128 rows inverted in one program of 4 waves (a 128 x 128 compare) spilled 27 VGPRs in
    # `_combine_dweights_kernel` (gfx1100); 64 rows at most, longer orders inverted in their own launch
    "moe_combine_bwd": {"one_block": 64},
}
"""Radeon RX 7900 (gfx1100, RDNA3), and the base of RX 9070's (gfx1201, RDNA4): 32-lane waves."""

RDNA4: Table = {
    **RDNA,
    "attention_bwd": {
        "tiles": {**_RDNA_ATTENTION["bwd"], **{d: Tiles(32, 32, 8, 1) for d in (16, 32, 64)},
                  256: Tiles(16, 16, 16, 1)},
        "fp32_tiles": {**{d: Tiles(16, 16, 8, 1) for d in (16, 32, 64)}, 128: Tiles(16, 16, 16, 1),
                       256: Tiles(16, 16, 16, 1)},
    },
}
"""RX 9070 (gfx1201): RDNA, with a backward that gfx1201's compiler spilled at RDNA3's tiles in the AOT check
(every case): 32 x 32 in 8 waves up to head dim 64 (4: 10 VGPRs with the causal mask), 16 x 16 in 16 at head
dim 256 (in 4: 62-211, in 8: 13-128); float32 in 16 x 16, one stage, in 8 waves up to head dim 64 (the portable
16 x 32 in 4, two stages: 10-658; none in 16 x 16 and 8) and in 16 from head dim 128, where every tile spills
(`SPILLS`)."""

TABLES: dict[str, Table] = {"gfx942": CDNA, "gfx950": GFX950, "gfx90a": GFX90A, "gfx1100": RDNA, "gfx1201": RDNA4}
"""By `kpt_rocm.device.gcn_arch` (and ``$KPT_ROCM_ARCH`` under the interpreter)."""

_RDNA3_BWD = ("head dim 128 on RDNA3 spills at every tile tried in the AOT check (16x16 and 16x32 keys, 4 and "
              "8 waves: {} to {} spills); 16x16 in 4 waves spills least; correct, its speed not yet measured on "
              "hardware")

_RDNA_FP32_FWD = ("float32 at head dim 256 only (a conformance dtype, not a performance path): the smallest tile, "
                  "16 x 16, spilled 562, 156 and 163 VGPRs in 4, 8 and 16 waves in the AOT check on gfx1100 (causal; "
                  "156 in 8 on gfx1201); 8 waves spill least; every other forward spills none")

_RDNA4_BWD = ("float32 (a conformance dtype, not a performance path) from head dim 128 on spills at the smallest tile, "
              "16 x 16, in the AOT check: at head dim 128 dk/dv 80-104 VGPRs, dq 165-168 in 16 waves (in 8: 140-159 "
              "and 184-187, in 4: 423-471), at 256 dk/dv 466, dq 588 (in 8: 449 and 644, in 4: 1119 and 1263)"
              "{dkdv}; 16 waves spill least; every other backward spills none")

SPILLS: dict[str, dict[str, str]] = {
    "gfx1100": {"_attn_bwd_dkdv_kernel": _RDNA3_BWD.format(123, 172),
                "_attn_bwd_dq_kernel": _RDNA3_BWD.format(47, 257),
                "_attn_fwd_kernel": _RDNA_FP32_FWD},
    "gfx1201": {"_attn_bwd_dkdv_kernel": _RDNA4_BWD.format(dkdv="; 16 bits at head dim 256: 92-100 in 16 waves, "
                                                                "187-211 in 4"),
                "_attn_bwd_dq_kernel": _RDNA4_BWD.format(dkdv=""),
                "_attn_fwd_kernel": _RDNA_FP32_FWD},
}
"""Register spills accepted per arch, by Triton kernel name, with the reason."""
