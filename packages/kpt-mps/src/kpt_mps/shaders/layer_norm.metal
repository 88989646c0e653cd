// Layer normalization over the last dimension, one threadgroup per row (two-pass variance).
//   y = (x − mean) · rstd · w + b,   rstd = rsqrt(mean((x − mean)²) + eps)
//   dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)),  g = dy · w;   dw = Σ_rows dy · x̂,  db = Σ_rows dy

// ip: D, code of x/y, code of w (-1: none), code of b (-1: none); fp: eps
kernel void layer_norm_fwd(device const uchar* x [[buffer(0)]], device const uchar* w [[buffer(1)]],
                           device const uchar* b [[buffer(2)]], device uchar* y [[buffer(3)]],
                           device float* mean_out [[buffer(4)]], device float* rstd_out [[buffer(5)]],
                           constant long* ip [[buffer(6)]], constant float* fp [[buffer(7)]],
                           uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                           uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long d = ip[0], base = long(row) * d;
  int xc = int(ip[1]), wc = int(ip[2]), bc = int(ip[3]);
  float n = float(d > 0 ? d : 1);
  float s = 0.0f;
  for (long c = lid; c < d; c += nt) s += load(x, base + c, xc);
  float mean = group_sum(s, partial, lid, nt) / n;
  float ss = 0.0f;
  for (long c = lid; c < d; c += nt) { float v = load(x, base + c, xc) - mean; ss += v * v; }
  float r = precise::rsqrt(group_sum(ss, partial, lid, nt) / n + fp[0]);
  for (long c = lid; c < d; c += nt) {
    float v = (load(x, base + c, xc) - mean) * r;
    if (wc >= 0) v *= load(w, c, wc);
    if (bc >= 0) v += load(b, c, bc);
    store(y, base + c, xc, v);
  }
  if (lid == 0) { mean_out[row] = mean; rstd_out[row] = r; }
}

// ip: D, code of x/dy/dx, code of w (-1: none)
kernel void layer_norm_bwd(device const uchar* x [[buffer(0)]], device const uchar* w [[buffer(1)]],
                           device const uchar* dy [[buffer(2)]], device const float* mean_in [[buffer(3)]],
                           device const float* rstd_in [[buffer(4)]], device uchar* dx [[buffer(5)]],
                           constant long* ip [[buffer(6)]],
                           uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                           uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long d = ip[0], base = long(row) * d;
  int xc = int(ip[1]), wc = int(ip[2]);
  float n = float(d > 0 ? d : 1), mean = mean_in[row], r = rstd_in[row];
  float sg = 0.0f, sgx = 0.0f;
  for (long c = lid; c < d; c += nt) {
    float g = load(dy, base + c, xc) * (wc >= 0 ? load(w, c, wc) : 1.0f);
    sg += g;
    sgx += g * (load(x, base + c, xc) - mean) * r;
  }
  float mg = group_sum(sg, partial, lid, nt) / n;
  float mgx = group_sum(sgx, partial, lid, nt) / n;
  for (long c = lid; c < d; c += nt) {
    float g = load(dy, base + c, xc) * (wc >= 0 ? load(w, c, wc) : 1.0f);
    float xhat = (load(x, base + c, xc) - mean) * r;
    store(dx, base + c, xc, r * (g - mg - xhat * mgx));
  }
}

// one thread per column: dw = Σ_rows dy · x̂ (code of w, -1: none), db = Σ_rows dy (code of b, -1: none)
// ip: rows, D, code of x/dy, code of dw, code of db
kernel void layer_norm_dparams(device const uchar* x [[buffer(0)]], device const uchar* dy [[buffer(1)]],
                               device const float* mean_in [[buffer(2)]], device const float* rstd_in [[buffer(3)]],
                               device uchar* dw [[buffer(4)]], device uchar* db [[buffer(5)]],
                               constant long* ip [[buffer(6)]], uint c [[thread_position_in_grid]]) {
  long n = ip[0], d = ip[1];
  int xc = int(ip[2]), wc = int(ip[3]), bc = int(ip[4]);
  if (long(c) >= d) return;
  float aw = 0.0f, ab = 0.0f;
  for (long r = 0; r < n; ++r) {
    float g = load(dy, r * d + c, xc);
    aw += g * (load(x, r * d + c, xc) - mean_in[r]) * rstd_in[r];
    ab += g;
  }
  if (wc >= 0) store(dw, c, wc, aw);
  if (bc >= 0) store(db, c, bc, ab);
}
