// Float8 in software: Apple GPUs have no float8 formats, so the kernels encode and decode the
// bits themselves (common.metal: fp8_encode, fp8_decode; round to nearest even, saturating).
//   scale = amax / fp8_max (1 where that is not > 0; NaN for a row holding a NaN),
//   xq = saturate(x / scale),  y = xq · scale

// one threadgroup per row of [rows, D] (per tensor: one row of every element).
// ip: D, code of x, fp8 max
kernel void fp8_scale(device const uchar* x [[buffer(0)]], device float* scale [[buffer(1)]],
                      constant long* ip [[buffer(2)]],
                      uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                      uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long d = ip[0], base = long(row) * d;
  int xc = int(ip[1]);
  float amax = 0.0f, nan_seen = 0.0f;  // max drops a NaN: it is counted on its own
  for (long c = lid; c < d; c += nt) {
    float v = fabs(load(x, base + c, xc));
    amax = max(amax, v);
    if (isnan(v)) nan_seen = 1.0f;
  }
  amax = group_max(amax, partial, lid, nt);
  nan_seen = group_max(nan_seen, partial, lid, nt);
  float s = amax / float(ip[2]);
  // a row (or tensor) holding a NaN has a NaN scale, as torch.amax gives
  if (lid == 0) scale[row] = nan_seen > 0.0f ? as_type<float>(0x7fc00000u) : (s > 0.0f ? s : 1.0f);
}

// xq = saturate(x / scale[e / width]) (width: the row length, or every element for one scale).
// ip: n, width, code of x, code of xq, fp8 max
kernel void fp8_quantize(device const uchar* x [[buffer(0)]], device const float* scale [[buffer(1)]],
                         device uchar* xq [[buffer(2)]], constant long* ip [[buffer(3)]],
                         uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0], width = ip[1];
  int xc = int(ip[2]), qc = int(ip[3]);
  float limit = float(ip[4]);
  for (long e = i; e < n; e += threads) {
    float q = load(x, e, xc) / scale[e / width];
    store(xq, e, qc, isnan(q) ? q : clamp(q, -limit, limit));  // NaN passes on (a NaN scale's row)
  }
}

// y = xq · scale[e / width] (a scale of 1 and width n: the float8 values in float32).
// ip: n, width, code of xq, code of y
kernel void fp8_dequantize(device const uchar* xq [[buffer(0)]], device const float* scale [[buffer(1)]],
                           device uchar* y [[buffer(2)]], constant long* ip [[buffer(3)]],
                           uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0], width = ip[1];
  int qc = int(ip[2]), yc = int(ip[3]);
  for (long e = i; e < n; e += threads) store(y, e, yc, load(xq, e, qc) * scale[e / width]);
}

// fp8_linear's epilogue: y = acc · x_scale[row] · w_scale[col] + bias, acc float32 [rows, N].
// ip: n, N, per-row x scale, per-column w scale, code of bias (-1: none), code of y
kernel void fp8_linear_epilogue(device const float* acc [[buffer(0)]], device const float* x_scale [[buffer(1)]],
                                device const float* w_scale [[buffer(2)]], device const uchar* bias [[buffer(3)]],
                                device uchar* y [[buffer(4)]], constant long* ip [[buffer(5)]],
                                uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0], cols = ip[1];
  bool x_rows = ip[2] != 0, w_cols = ip[3] != 0;
  int bc = int(ip[4]), yc = int(ip[5]);
  for (long e = i; e < n; e += threads) {
    long r = e / cols, c = e % cols;
    float v = acc[e] * x_scale[x_rows ? r : 0] * w_scale[w_cols ? c : 0];
    if (bc >= 0) v += load(bias, c, bc);
    store(y, e, yc, v);
  }
}
