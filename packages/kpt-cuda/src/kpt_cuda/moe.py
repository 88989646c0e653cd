"""Vendor-native top-k gating: CUDA C compiled at run time through CuPy, one warp per token.

Each lane holds the logits of experts ``lane, lane + 32, …`` (float32 in registers), so for
E ≤ 1024 a token's row never leaves the warp::

    m = warp max;  s = warp Σ exp(l − m)
    k times: warp argmax over the experts not yet taken (larger logit first, lower expert on ties)
    w = exp(l_chosen − m) / s,  or / Σ_chosen exp(l − m) with renormalize

The same contract and rules as ``kpt_triton.moe.moe_gating_fwd`` (indices equal, weights within
float32 rounding); rows wider than 1024 experts, and the backward, use the Triton kernels.
Used only where CuPy imports and a CUDA GPU is present (`available`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kpt_triton import moe as triton_moe

MAX_EXPERTS = 1024
"""32 logits per lane of one warp."""

_WARPS_PER_BLOCK = 4

_SOURCE = r"""
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
#if LOGIT_BITS == 32
typedef float logit_t;
#else
typedef unsigned short logit_t;  // float16 / bfloat16 bits, converted below without headers
#endif

__device__ __forceinline__ float load_logit(const logit_t* p) {
#if LOGIT_BITS == 32
    return *p;
#elif LOGIT_IS_BF16
    return __uint_as_float(((unsigned int)*p) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
    return f;
#endif
}

extern "C" __global__ void moe_gating_fwd(
        const logit_t* logits, long long stride_t, long long stride_e, int T, int E, int K, int renormalize,
        float* weights, int* indices) {
    const int lane = threadIdx.x & 31;
    const long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T) return;
    const logit_t* row = logits + t * stride_t;

    float v[PER_LANE];
    float m = NEG_INF;
    #pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        int e = lane + 32 * j;
        v[j] = e < E ? load_logit(row + e * stride_e) : NEG_INF;
        m = fmaxf(m, v[j]);
    }
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, off));
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < PER_LANE; ++j) s += lane + 32 * j < E ? expf(v[j] - m) : 0.0f;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(FULL, s, off);

    unsigned int taken = 0;
    float chosen = 0.0f;
    for (int slot = 0; slot < K; ++slot) {
        // this lane's best free expert, then the warp's: ties go to the lower expert, also at -inf
        float best = NEG_INF;
        int expert = 0x7fffffff;
        #pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            int e = lane + 32 * j;
            if (e < E && !(taken >> j & 1u) && (v[j] > best || (v[j] == best && e < expert))) {
                best = v[j];
                expert = e;
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            float other = __shfl_xor_sync(FULL, best, off);
            int other_expert = __shfl_xor_sync(FULL, expert, off);
            if (other > best || (other == best && other_expert < expert)) {
                best = other;
                expert = other_expert;
            }
        }
        if ((expert & 31) == lane) taken |= 1u << (expert >> 5);
        float p = expf(best - m);
        chosen += p;
        if (lane == 0) {
            weights[t * K + slot] = p;
            indices[t * K + slot] = expert;
        }
    }
    if (lane == 0) {
        float denom = renormalize ? chosen : s;
        for (int slot = 0; slot < K; ++slot) weights[t * K + slot] /= denom;
    }
}
"""


@functools.cache
def available() -> bool:
    """CuPy imports and sees a CUDA GPU."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


@functools.cache
def _kernel(dtype: torch.dtype, per_lane: int) -> Any:
    import cupy

    options = (f"-DLOGIT_BITS={torch.finfo(dtype).bits}", f"-DLOGIT_IS_BF16={int(dtype == torch.bfloat16)}",
               f"-DPER_LANE={per_lane}")
    return cupy.RawKernel(_SOURCE, "moe_gating_fwd", options=options)


def moe_gating_fwd(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(weights float32 [T, k], indices int32 [T, k])``, like the Triton body."""
    T, E = logits.shape
    if E > MAX_EXPERTS:
        return triton_moe.moe_gating_fwd(logits, k, renormalize)
    import cupy

    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    indices = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, indices
    per_lane = max(1, -(-E // 32))
    kernel = _kernel(logits.dtype, per_lane)
    stream = torch.cuda.current_stream(logits.device)
    with cupy.cuda.Device(logits.device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel(
            (-(-T // _WARPS_PER_BLOCK),), (32 * _WARPS_PER_BLOCK,),
            (np.uint64(logits.data_ptr()), np.int64(logits.stride(0)), np.int64(logits.stride(1)),
             np.int32(T), np.int32(E), np.int32(k), np.int32(renormalize),
             np.uint64(weights.data_ptr()), np.uint64(indices.data_ptr())),
        )
    return weights, indices


moe_gating_bwd = triton_moe.moe_gating_bwd
