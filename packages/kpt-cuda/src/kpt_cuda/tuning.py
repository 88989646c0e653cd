"""Tuning tables per NVIDIA architecture: keyword arguments bound into the kpt_triton launchers.

A table (`kpt_triton.backend.Table`) maps a launcher name (``rms_norm_fwd``...) to the values
of its keyword-only tuning parameters; a launcher that is absent, or a parameter that is not
listed, keeps its portable default. The reasoning behind the starting values (sm90 entries
since swept on hardware, below):

* memory-bound row kernels want one whole row per program up to 16K columns (read once) and
  about 16 elements per thread, i.e. 16-byte vector loads of 16-bit data (``elems_per_warp``
  512); small rows are packed several per program so that a program still moves ~8 KB;
* persistent backward grids: as many programs per SM as stay resident together (a 4096-wide
  row tile of 8 warps holds ~64 float32 registers per thread: 4 programs fill the register
  file), so that no second wave straggles; the partial ``dweight`` buffer stays small;
* cross-entropy reads 128K-wide rows: bigger chunks halve the per-chunk reductions;
* ``fp8_linear`` uses ``torch._scaled_mm`` on Hopper (float8 tensor cores; Ampere has none), and
  the float8 kernels convert with Hopper's float8 instructions (``native_cast``).
"""

from __future__ import annotations

from kpt_triton.attention import Decode, Tiles
from kpt_triton.backend import Table

from .attention import WarpSpecialized

_ROW_SM90 = {"tile_elems": 4096, "elems_per_warp": 512}
_POINTWISE_SM90 = {"block": 8192, "elems_per_warp": 512}

# measured on an H100 80GB HBM3 (scripts/tune_sweep.py, bf16 docs/performance.md shapes, 2026-11-21):
# rms_norm_bwd 0.230 -> 0.172 ms, softmax_fwd 0.221 -> 0.184 ms, rope_fwd 0.241 -> 0.231 ms,
# cross_entropy_fwd 0.740 -> 0.712 ms against the portable defaults; second sweep (same day):
# cross_entropy_fwd with the gradient 2.31 -> 1.88 ms, layer_norm_fwd 0.101 -> 0.097 ms,
# quantize_fp8_fwd (row) 0.241 -> 0.137 ms, moe_gating_fwd 13.6 -> 11.5 us; third sweep, on an
# H200 (also sm90), with streamed output stores: softmax_fwd 0.189 -> 0.153 ms, layer_norm_fwd
# 0.101 -> 0.092 ms, rope_fwd (q and k in one launch) 0.197 -> 0.181 ms (kept for HBM3e parts
# below); fourth sweep, H100 again: rope_fwd wants narrower warps there, 0.2304 -> 0.2272 ms;
# fifth, H100, after layer_norm_fwd stopped compiling its chunk loops for one-chunk rows: 8 warps
# per 4096-wide row, 0.0951 -> 0.0938 ms (the H200 keeps its own sweep's entry); sixth, H100, at the
# model sweep's shapes too (2026-11-26): layer_norm_bwd 0.266 -> 0.190 ms (4096 x 4096: 0.112 -> 0.072,
# 65536 x 8192: 1.874 -> 1.785), gelu_bwd 0.391 -> 0.360 ms (4096 x 14336: 0.133 -> 0.122),
# softmax_fwd with rows up to 32768 read once (longer ones still in 16K chunks): 4096 x 32768
# 0.252 -> 0.195 ms, 4096 x 24000 0.235 -> 0.165 ms, the perf shape and 4096 x 128256 unchanged
# (the H200 keeps the earlier entries of these three: not measured there); seventh, H100, after the
# norm backwards stopped compiling chunk loops for one-chunk rows (2026-11-27): layer_norm_bwd at
# 65536 x 8192 1787 -> 1260 us (16 warps a row; 16384 x 4096 224 -> 184), rms_norm_bwd with 16 warps per
# 16384-element tile 1239 -> 1133 us at 65536 x 8192, 91 -> 55 at 4096 x 4096 (add_rms_norm_bwd, which
# reads one more tensor, not swept: it keeps the sixth sweep's tile). Eighth, H100, a decode step's few
# rows (2026-12-06, CUDA-graph replays, bf16): a backward of 2 to 4 tiles in one program writes dweight
# itself, no partial sums to add and cast: rms_norm_bwd 8 x 4096 6.82 -> 5.13 us (2 tiles; 4 tiles in
# one program, 16 x 4096 or 8 x 8192, 7.2 -> 9.2: kept at 2), add_rms_norm_bwd 2 x 4096 5.69 -> 2.96,
# 4 x 4096 5.70 -> 4.59, 8 x 2048 5.83 -> 4.44 (8 tiles in one program, 8 x 4096: 6.0 -> 7.9: kept at 4).
# Ninth, H100, softmax_bwd at the model sweep's widths and others (2026-12-06, CUDA-graph replays): rows of
# exactly 8192 run two a program (tile_elems_at), 8192 x 8192 148.4 -> 134.5 us, 2048 x 8192 40.1 -> 37.0,
# and rows of exactly 1024 two, not four: 65536 x 1024 141.2 -> 132.4, 4096 x 1024 6.3 -> 4.6. Not by
# block width: rows of 5000 two a program lost their aligned vectors (63.0 -> 89.8 us at 4096 x 5000);
# 16384 x 1000 gained 5% (39.2 -> 37.3), not taken. A 16384 tile at every width was slower elsewhere;
# widths 2048 to 32768 and 512 keep the table (within 1% of the best there)
_NORM_BWD_SM90 = {"tile_elems": 4096, "elems_per_warp": 1024, "programs_per_sm": 2, "one_program_tiles": 4}
_ROPE_SM90 = {"tile_elems": 1024, "elems_per_warp": 512, "stream": True}

# tiles chosen in the AOT check (`python -m kpt_triton.aot`, every conformance case), not timed: at
# head dim 256 the portable forward's 32 x 32 keys in 8 warps spilled 24 bytes a thread (16 bits,
# causal), its float32 16 x 32 41628; 4 warps and 16 x 16 spill none. Float32's backward at head dim
# 128 in one stage (16 x 16, 8 warps): two stages spilled 12 bytes a thread with the causal mask
_ATTENTION_FWD_SM90 = {"tiles": {256: Tiles(32, 32, 4, 2)}, "fp32_tiles": {256: Tiles(16, 16, 4, 2)}}

SM90: Table = {
    "rms_norm_fwd": _ROW_SM90,
    "rms_norm_bwd": {"tile_elems": 16384, "elems_per_warp": 1024, "programs_per_sm": 1, "one_program_tiles": 2},
    "add_rms_norm_fwd": _ROW_SM90,
    "add_rms_norm_bwd": _NORM_BWD_SM90,
    "layer_norm_fwd": {"tile_elems": 4096, "elems_per_warp": 512},
    "layer_norm_bwd": {"tile_elems": 8192, "elems_per_warp": 512, "programs_per_sm": 1},
    "softmax_fwd": {"tile_elems": 4096, "elems_per_warp": 1024, "stream": True, "max_block": 32768},
    "softmax_bwd": {**_ROW_SM90, "tile_elems_at": ((1024, 2048), (8192, 16384))},
    **{f"{k}_{d}": _POINTWISE_SM90 for k in ("gelu", "silu", "swiglu", "geglu") for d in ("fwd", "bwd")},
    "gelu_bwd": {"block": 4096, "elems_per_warp": 512},
    "rope_fwd": {"tile_elems": 2048, "elems_per_warp": 256},
    "rope_bwd": _ROPE_SM90,
    "cross_entropy_fwd": {"block_v": 16384, "elems_per_warp": 1024, "programs_per_sm": 4},
    "moe_gating_fwd": {"tile_elems": 1024, "num_warps": 4},
    # 128 pairs of float32 rows copied 64 columns a step spilled 48 bytes a thread (AOT check), 32 none
    "moe_dispatch_fwd": {"block_h": 32},
    "attention_fwd": _ATTENTION_FWD_SM90,
    "attention_bwd": {"fp32_tiles": {128: Tiles(16, 16, 8, 1)}},
    "linear_cross_entropy_fwd": {"block_v": 16384, "elems_per_warp": 1024},
    "linear_cross_entropy_bwd": {"block_v": 16384, "elems_per_warp": 1024},
    "quantize_fp8_fwd": {"tile_elems": 4096, "block": 8192, "elems_per_warp": 1024, "programs_per_sm": 4,
                         "native_cast": True},
    "dequantize_fp8_fwd": {"block": 8192, "native_cast": True},
    "fp8_linear_fwd": {"scaled_mm": True, "native_cast": True},
}

SM90_HBM3E: Table = {**SM90, "layer_norm_fwd": {"tile_elems": 4096, "elems_per_warp": 2048, "stream": True},
                     "rope_fwd": _ROPE_SM90,
                     # the decode kernel: one program a multiprocessor, 128 keys a step in 3 stages
                     # (128-208 KB of shared memory at head dim 128), 8 warps for 128 query rows (with 4:
                     # 560 spilled bytes a thread); on an H200 (2026-11-28) 3.3-6.3x SDPA's best at the
                     # attention sweep's multi-query decode shapes, 1.3x the portable plan at B8 H32/8
                     # Sq8 Skv8192 (70.5 against 87.0 us). Not swept on an H100, which keeps the portable plan.
                     "attention_fwd": {**_ATTENTION_FWD_SM90,
                                       "decode": Decode(block_n=128, num_stages=3, programs_per_sm=1,
                                                        split_keys=512, wide_warps=8),
                                       # the forward's tiles where kpt-cuda runs it (`kpt_cuda.attention`): on an
                                       # H200 the best of 6-9 tiles at B4 H32 S4096 D128 and B8 H32 S1024 D64,
                                       # 1.5-2.3x the portable ones (D128 causal 393 against 252 TFLOP/s)
                                       "tiles": {**_ATTENTION_FWD_SM90["tiles"], 64: Tiles(128, 64, 8, 3),
                                                 128: Tiles(128, 128, 8, 3)},
                                       # kpt's Hopper forward (`kpt_cuda.attention`), persistent, in L2 sections of
                                       # 16 MiB of K and V: on an H200 (2026-11-29) causal chunks 1.7-2.4x
                                       # FlashAttention-2 where its tiles fill half the SMs with 40 blocks of
                                       # pairs each (0.45-0.8x below); equal lengths 1.02-1.15x cuDNN from 2048
                                       # keys and 1024 tiles causal, 4096 keys and 2048 tiles without a mask
                                       # (0.84-0.99x with fewer; sections of 4-32 MiB within 2% of each other)
                                       "warp_specialized": WarpSpecialized(stages=2, l2_section=16 << 20, min_fill=0.5,
                                                                           min_blocks=40, full_from=(4096, 2048),
                                                                           causal_from=(2048, 1024))},
                     # the sixth (H100) sweep's entries, not measured on an H200: the earlier ones
                     "layer_norm_bwd": {**_ROW_SM90, "programs_per_sm": 4},
                     "softmax_fwd": {"tile_elems": 4096, "elems_per_warp": 1024, "stream": True},
                     "gelu_bwd": _POINTWISE_SM90}
"""Hopper with HBM3e (H200): the sm90 table, except where the H200 sweep chose differently or the
H100's latest sweep was not repeated on it."""

_ROW_SM80 = {"tile_elems": 4096, "elems_per_warp": 512}
_ROW_BWD_SM80 = {**_ROW_SM80, "programs_per_sm": 4}

# The norm backwards, chosen in the AOT check at every conformance case (sm80), not timed. A row of 8192
# read once in 16 warps spilled 168-524 bytes a thread (ptxas caps 512 threads at 128 registers; in 8
# warps 432-504 with the gradient of h): rows wider than 4096 go in chunks of 4096, which rms_norm's
# backward holds in 8 warps with no spill. Layer norm's chunk loop at 4096 columns spilled 168 bytes in 8
# warps and 136-212 in 16, at 2048 none: its rows wider than 2048 go in chunks of 2048 (4096-wide rows,
# the performance shape among them, read their second half twice, from L2 at best). add_rms_norm's
# backward also spilled 8-28 bytes a thread at 48-64 registers in 2048- and 4096-element tiles of narrow
# rows (5 x 256 without a weight, 1 x 1) in 4 and 8 warps: tiles of 1024 elements in one warp spill none
# (768 elements a warp: `kpt_triton.tiling.warps` still gives a 4096-column chunk 8 warps)
_RMS_NORM_BWD_SM80 = {**_ROW_BWD_SM80, "max_block": 4096}
_NARROW_NORM_BWD_SM80 = {**_RMS_NORM_BWD_SM80, "tile_elems": 1024, "elems_per_warp": 768}

SM80: Table = {
    "rms_norm_fwd": _ROW_SM80,
    "rms_norm_bwd": _RMS_NORM_BWD_SM80,
    "add_rms_norm_fwd": _ROW_SM80,
    "add_rms_norm_bwd": _NARROW_NORM_BWD_SM80,
    "layer_norm_fwd": _ROW_SM80,
    "layer_norm_bwd": {**_ROW_BWD_SM80, "max_block": 2048},
    "softmax_fwd": _ROW_SM80,
    "softmax_bwd": _ROW_SM80,
    "cross_entropy_fwd": {"block_v": 8192, "elems_per_warp": 512},
    # chosen in the AOT check at every conformance case (sm80), not timed: the dispatch's 128 pairs copied 64
    # columns a step spilled 16-168 bytes a thread (32: none); the decode kernel at head dim 80, 16 rows x 64 keys
    # in 4 warps, 8 (8 warps: none); the dk/dv kernel at head dim 64 in 32 x 64 tiles 12-392 (16 bits; 32 x 32
    # in 4 warps 12 with the causal mask, in one stage 12, 8 warps none). Float32's backward (a conformance dtype)
    # in 4 warps spilled 8-12 bytes a thread with the causal mask at head dim 64 (16 x 32) and 256 (16 x 16): in 8
    # warps none (at head dim 64 in one stage: two spilled 12-32 with a mask). The grouped GEMM's 64 x 64 x 32
    # tiles in 3 stages spilled 8 bytes in float32 (2 stages: none; 8 warps 8, 16-wide K steps 8-24); bfloat16
    # runs the same tiles here (torch._grouped_mm is kpt-cuda's on Hopper only)
    "moe_dispatch_fwd": {"block_h": 32},
    "attention_fwd": {"decode": Decode(num_warps=8)},
    "attention_bwd": {"tiles": {64: Tiles(32, 32, 8, 2)},
                      "fp32_tiles": {64: Tiles(16, 32, 8, 1), 256: Tiles(16, 16, 8, 2)}},
    "grouped_linear_fwd": {"num_stages": 2},
    "grouped_linear_bwd": {"num_stages": 2},
    "fp8_linear_fwd": {"scaled_mm": False},
}

# Blackwell (B200, B300): sm90's table where it compiles without a spill, else entries chosen in the AOT check at
# every conformance case (sm100, Triton 3.6), none timed on a Blackwell GPU. The sm90 entries that spill on sm90,
# accepted there with an H100's timings, spilled here too, as did others: the norm backwards' 16-warp tiles
# 8-608 bytes a thread (in 8 warps, rows of 8192 with the gradient of h 192-240) take sm80's norm backwards
# (rms_norm's with add_rms_norm's narrow tiles: in 4 warps, 8 x 256 without a weight spilled 8); the softmax
# span kernel's 16384 columns in 16 warps 32 (chunks of 8192: none); the dispatch's 32 columns in 4 warps 24
# (16 columns 8-48; 8 warps none); the quantize rows' 64 x 64 tiles in 4 warps and the amax's 8 x 1024 in 8,
# 8-40 (512 elements a warp: none); the float32 grouped GEMM 72-112 (2 stages 232-264; 8 warps none); the
# 16-bit dk/dv kernel's 32 x 64 tiles at head dims 16-64 8-636 (32 x 32 in 8 warps; at head dim 32 with a mask
# 12-24, 16 x 32 in 4 warps none); float32's backward in 4 warps 8-68 at head dims 16, 64 and 256, the decode
# kernel 8-16 at head dims 16 (4 warps, a mask), 32 and 80 (float32, the forward's 64 keys in 2 stages)
SM100: Table = {
    **SM90,
    "rms_norm_bwd": _NARROW_NORM_BWD_SM80,
    "add_rms_norm_bwd": _NARROW_NORM_BWD_SM80,
    "layer_norm_bwd": SM80["layer_norm_bwd"],
    "softmax_fwd": {**SM90["softmax_fwd"], "chunk": 8192},
    # sm90's two rows of 8192 a tile spill there (accepted with an H100's timing); the rows of 1024 do not
    "softmax_bwd": {**SM90["softmax_bwd"], "tile_elems_at": ((1024, 2048),)},
    "moe_dispatch_fwd": {"block_h": 32, "num_warps": 8},
    "attention_fwd": {**_ATTENTION_FWD_SM90, "decode": Decode(num_warps=8),
                      "fp32_tiles": {**_ATTENTION_FWD_SM90["fp32_tiles"], 32: Tiles(32, 32, 8, 2),
                                     128: Tiles(32, 64, 8, 1)}},
    "attention_bwd": {"tiles": {16: Tiles(32, 32, 8, 2), 32: Tiles(16, 32, 4, 2), 64: Tiles(32, 32, 8, 2)},
                      "fp32_tiles": {16: Tiles(16, 16, 4, 2), 32: Tiles(16, 32, 8, 1), 64: Tiles(16, 32, 8, 1),
                                     128: Tiles(16, 16, 8, 1), 256: Tiles(16, 16, 8, 1)}},
    "grouped_linear_fwd": {"num_warps": 8},
    "grouped_linear_bwd": {"num_warps": 8},
    "quantize_fp8_fwd": {**SM90["quantize_fp8_fwd"], "elems_per_warp": 512},
}
"""Data-centre Blackwell (compute capability 10.x): chosen without a GPU, never timed."""

TABLES: dict[str, Table] = {"sm80": SM80, "sm90": SM90, "sm90-hbm3e": SM90_HBM3E, "sm100": SM100, "interpret": {}}
"""By `kpt_cuda.device.arch` tag; under the Triton interpreter the portable defaults."""

_SPILLS_SM90 = {
    "_rms_norm_bwd_kernel": "4 rows of 4096 (2 of 8192) per tile in 16 warps: 56-104 spilled bytes a thread (AOT "
                            "check); kept, the fastest tile of the seventh H100 sweep at every shape (1239 -> 1133 "
                            "us at 65536 x 8192, above)",
    "_layer_norm_bwd_kernel": "16 warps a tile of 8192 (one row of 8192, 8 of 1024): 88-568 spilled bytes a thread "
                              "(AOT check, 344 in 16 bits); kept, the tile of the seventh H100 sweep, measured with "
                              "these spills (1787 -> 1260 us at 65536 x 8192, above)",
    "_quantize_rows_kernel": "rows of 32 and 64 columns, 128 and 64 a tile in 4 warps: 8-176 spilled bytes a thread "
                             "(AOT check); the swept entry's tile (0.241 -> 0.137 ms at the performance shape, above) "
                             "spills none at the other widths (1 column, 128 to 8192)",
    "_amax_kernel": "the per-tensor amax at rows of 1024 columns, 8 x 1024 tiles in 8 warps (16 bits): 16 spilled "
                    "bytes a thread (AOT check); wider rows spill none; 32 elements a thread, the row path's swept "
                    "value, which this pass shares",
    "_grouped_mm_kernel": "float32 (a conformance dtype: IEEE dots on FMA units), 64 x 64 x 32 tiles in 4 warps: "
                          "96-104 spilled bytes a thread (AOT check); 16 bits spill none (bfloat16 runs "
                          "torch._grouped_mm where it can)",
    "_softmax_bwd_kernel": "two rows of 8192 a tile in 16 warps (tile_elems_at): 72 spilled bytes a thread (AOT "
                           "check); kept, measured with these spills (8192 x 8192 148.4 -> 134.5 us, the ninth H100 "
                           "sweep above)",
    "_attn_bwd_dkdv_kernel": "float32 (a conformance dtype, not a performance path): 8-40 spilled bytes a thread at "
                             "head dims 16, 64 (causal or masked) and 256 (AOT check); smaller tiles spill more "
                             "(16 x 16: 36-48 at head dim 64, 40-48 at 256 in 4 or 8 warps; one stage 8-76)",
}

SPILLS: dict[str, dict[str, str]] = {
    "sm90": _SPILLS_SM90,
    "sm90-hbm3e": {**_SPILLS_SM90,
                   "_attn_decode_kernel": "the decode plan's tiles of 16 rows that write the output directly "
                                          "(one chunk): 8 spilled bytes a thread at head dims 64 and 128 (AOT "
                                          "check); kept, on an H200 B16 H32/8 Sq2 Skv2048 D128 (one chunk) took "
                                          "35.6 us, 36.0 with 8 warps and no spill"},
}
"""Register spills accepted per arch (`python -m kpt_triton.aot`), by Triton kernel name, with the reason."""
