// RMS normalization and its residual-add form, one threadgroup per row.
//   rstd = rsqrt(mean(h²) + eps),  y = h · rstd · w
//   dx   = rstd · (g − x̂ · mean(g · x̂)),  g = dy · w,  x̂ = h · rstd;   dw = Σ_rows dy · x̂

// ip: D, code of x (and y), code of w (-1: none), code of the residual (-1: none); fp: eps.
// With a residual, h = x + residual is rounded to x's dtype and stored.
kernel void rms_norm_fwd(device const uchar* x [[buffer(0)]], device const uchar* residual [[buffer(1)]],
                         device const uchar* w [[buffer(2)]], device uchar* y [[buffer(3)]],
                         device uchar* h [[buffer(4)]], device float* rstd [[buffer(5)]],
                         constant long* ip [[buffer(6)]], constant float* fp [[buffer(7)]],
                         uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                         uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long d = ip[0], base = long(row) * d;
  int xc = int(ip[1]), wc = int(ip[2]), rc = int(ip[3]);
  float ss = 0.0f;
  for (long c = lid; c < d; c += nt) {
    float v = load(x, base + c, xc);
    if (rc >= 0) {
      store(h, base + c, xc, v + load(residual, base + c, rc));
      v = load(h, base + c, xc);
    }
    ss += v * v;
  }
  ss = group_sum(ss, partial, lid, nt);
  float r = precise::rsqrt(ss / float(d > 0 ? d : 1) + fp[0]);
  device const uchar* src = rc >= 0 ? (device const uchar*)h : x;
  for (long c = lid; c < d; c += nt) {
    float v = load(src, base + c, xc) * r;
    if (wc >= 0) v *= load(w, c, wc);
    store(y, base + c, xc, v);
  }
  if (lid == 0) rstd[row] = r;
}

// ip: D, code of h/dy/dx, code of w (-1: none), code of dh (-1: none, the gradient flowing into h)
kernel void rms_norm_bwd(device const uchar* h [[buffer(0)]], device const uchar* w [[buffer(1)]],
                         device const uchar* dy [[buffer(2)]], device const uchar* dh [[buffer(3)]],
                         device const float* rstd [[buffer(4)]], device uchar* dx [[buffer(5)]],
                         constant long* ip [[buffer(6)]],
                         uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                         uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long d = ip[0], base = long(row) * d;
  int xc = int(ip[1]), wc = int(ip[2]), hc = int(ip[3]);
  float r = rstd[row];
  float dot = 0.0f;
  for (long c = lid; c < d; c += nt) {
    float g = load(dy, base + c, xc) * (wc >= 0 ? load(w, c, wc) : 1.0f);
    dot += g * load(h, base + c, xc) * r;
  }
  float mean = group_sum(dot, partial, lid, nt) / float(d > 0 ? d : 1);
  for (long c = lid; c < d; c += nt) {
    float g = load(dy, base + c, xc) * (wc >= 0 ? load(w, c, wc) : 1.0f);
    float v = r * (g - load(h, base + c, xc) * r * mean);
    if (hc >= 0) v += load(dh, base + c, hc);
    store(dx, base + c, xc, v);
  }
}

// dw[c] = Σ_rows dy · h · rstd, one thread per column. ip: rows, D, code of h/dy, code of dw
kernel void rms_norm_dweight(device const uchar* h [[buffer(0)]], device const uchar* dy [[buffer(1)]],
                             device const float* rstd [[buffer(2)]], device uchar* dw [[buffer(3)]],
                             constant long* ip [[buffer(4)]], uint c [[thread_position_in_grid]]) {
  long n = ip[0], d = ip[1];
  int xc = int(ip[2]), wc = int(ip[3]);
  if (long(c) >= d) return;
  float acc = 0.0f;
  for (long r = 0; r < n; ++r) acc += load(dy, r * d + c, xc) * load(h, r * d + c, xc) * rstd[r];
  store(dw, c, wc, acc);
}
