// Shared by every kpt-mps shader (prepended to each family's source).
//
// Tensors reach a kernel as untyped buffers with a dtype code (uniform over a dispatch), so that
// one compiled library serves float32, float16 and bfloat16 activations, float32 parameters with
// 16-bit activations, and the two float8 formats. Everything is computed in float32.
#include <metal_stdlib>
using namespace metal;

constant int F32 = 0;
constant int F16 = 1;
constant int BF16 = 2;
constant int E4M3 = 3;
constant int E5M2 = 4;

// ---- float8 in software (Apple GPUs have no float8 arithmetic) -------------------------------
inline float fp8_decode(uint b, int mbits, int bias, bool has_inf) {
  float sign = (b & 0x80u) ? -1.0f : 1.0f;
  int e = int((b & 0x7fu) >> mbits);
  int m = int(b & ((1u << mbits) - 1u));
  int emax = (1 << (7 - mbits)) - 1;
  if (has_inf && e == emax) return m ? NAN : sign * INFINITY;
  if (!has_inf && e == emax && m == (1 << mbits) - 1) return NAN;
  if (e == 0) return sign * ldexp(float(m), 1 - bias - mbits);
  return sign * ldexp(float(m + (1 << mbits)), e - bias - mbits);
}

// round to nearest even; the caller has saturated |v| to the format's largest finite value
inline uint fp8_encode(float v, int mbits, int bias) {
  uint sign = signbit(v) ? 0x80u : 0u;
  if (isnan(v)) return sign | 0x7fu;
  float a = fabs(v);
  if (a == 0.0f) return sign;
  int e;
  frexp(a, e);
  int exponent = e - 1, emin = 1 - bias;
  if (exponent < emin) return sign | uint(rint(ldexp(a, mbits - emin)));  // subnormal (may round up to the min normal)
  int q = int(rint(ldexp(a, mbits - exponent)));
  if (q == (2 << mbits)) { exponent += 1; q = 1 << mbits; }
  return sign | (uint(exponent + bias) << mbits) | uint(q - (1 << mbits));
}

// ---- loads and stores by dtype code -----------------------------------------------------------
inline float bf16_to_float(ushort b) { return as_type<float>(uint(b) << 16); }

inline ushort float_to_bf16(float v) {
  uint u = as_type<uint>(v);
  if (isnan(v)) return ushort((u >> 16) | 0x40u);
  return ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float load(device const uchar* base, long i, int code) {
  if (code == F32) return ((device const float*)base)[i];
  if (code == F16) return float(((device const half*)base)[i]);
  if (code == BF16) return bf16_to_float(((device const ushort*)base)[i]);
  if (code == E4M3) return fp8_decode(base[i], 3, 7, false);
  return fp8_decode(base[i], 2, 15, true);
}

inline void store(device uchar* base, long i, int code, float v) {
  if (code == F32) ((device float*)base)[i] = v;
  else if (code == F16) ((device half*)base)[i] = half(v);
  else if (code == BF16) ((device ushort*)base)[i] = float_to_bf16(v);
  else if (code == E4M3) base[i] = uchar(fp8_encode(v, 3, 7));
  else base[i] = uchar(fp8_encode(v, 2, 15));
}

// ---- threadgroup reductions (every thread of the group calls them; all get the result) ---------
inline float group_sum(float v, threadgroup float* partial, uint lid, uint threads) {
  v = simd_sum(v);
  if (lid % 32 == 0) partial[lid / 32] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < (threads + 31) / 32; ++s) total += partial[s];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next reduction reuses partial
  return total;
}

inline float group_max(float v, threadgroup float* partial, uint lid, uint threads) {
  v = simd_max(v);
  if (lid % 32 == 0) partial[lid / 32] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float best = -INFINITY;
  for (uint s = 0; s < (threads + 31) / 32; ++s) best = max(best, float(partial[s]));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return best;
}

// ---- activations -----------------------------------------------------------------------------
constant int ACT_NONE = 0;
constant int ACT_RELU = 1;
constant int ACT_GELU = 2;
constant int ACT_GELU_TANH = 3;
constant int ACT_SILU = 4;

// erfc with relative error below 1.2e-7 (a Chebyshev fit, Numerical Recipes' erfcc); Metal has no erf
inline float erfc_approx(float x) {
  float z = fabs(x);
  float t = 1.0f / (1.0f + 0.5f * z);
  float poly = -z * z - 1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f +
               t * (-0.18628806f + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f +
               t * (-0.82215223f + t * 0.17087277f))))))));
  float r = t * precise::exp(poly);
  return x >= 0.0f ? r : 2.0f - r;
}

inline float sigmoid(float x) {
  // exp of a non-positive number only: no overflow for |x| in the hundreds
  float e = precise::exp(-fabs(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

inline float tanh_stable(float u) {
  float e = precise::exp(-2.0f * fabs(u));
  return copysign((1.0f - e) / (1.0f + e), u);
}

inline float act(float x, int kind) {
  if (kind == ACT_RELU) return x < 0.0f ? 0.0f : x;  // NaN passes on
  if (kind == ACT_GELU) return 0.5f * x * erfc_approx(-x * 0.70710678118654752f);
  if (kind == ACT_GELU_TANH) return 0.5f * x * (1.0f + tanh_stable(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  if (kind == ACT_SILU) return x * sigmoid(x);
  return x;
}

inline float act_grad(float x, int kind) {
  if (kind == ACT_RELU) return x <= 0.0f ? 0.0f : 1.0f;  // relu'(NaN) = 1, as in torch
  if (kind == ACT_GELU)
    return 0.5f * erfc_approx(-x * 0.70710678118654752f) + x * precise::exp(-0.5f * x * x) * 0.3989422804014327f;
  if (kind == ACT_GELU_TANH) {
    float t = tanh_stable(0.7978845608028654f * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
  }
  if (kind == ACT_SILU) { float s = sigmoid(x); return s * (1.0f + x * (1.0f - s)); }
  return 1.0f;
}
