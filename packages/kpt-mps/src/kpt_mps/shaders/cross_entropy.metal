// Cross-entropy of [N, V] logits, one threadgroup per row (also the logits of linear_cross_entropy).
//   lse = log Σ exp(z),  loss = (1 − ε)(lse − z_t) + ε (lse − mean z)   (0 if ignored, NaN if t ∉ [0, V))
//   dz  = unit · (softmax(z) − (1 − ε) onehot(t) − ε / V),  unit = the gradient reaching the row's loss

// ip: V, code of z, ignore_index, write dz, code of dz; fp: ε
kernel void cross_entropy_fwd(device const uchar* z [[buffer(0)]], device const long* target [[buffer(1)]],
                              device const float* unit [[buffer(2)]], device float* losses [[buffer(3)]],
                              device float* lse_out [[buffer(4)]], device uchar* dz [[buffer(5)]],
                              constant long* ip [[buffer(6)]], constant float* fp [[buffer(7)]],
                              uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                              uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long v = ip[0], base = long(row) * v, t = target[row];
  int zc = int(ip[1]), dc = int(ip[4]);
  bool grad = ip[3] != 0, kept = t != ip[2], in_range = t >= 0 && t < v;
  float eps = fp[0];
  float m = -INFINITY, total = 0.0f, nans = 0.0f;
  for (long c = lid; c < v; c += nt) {
    float x = load(z, base + c, zc);
    m = max(m, x);  // drops NaN: counted apart
    total += x;
    nans += isnan(x) ? 1.0f : 0.0f;
  }
  m = group_max(m, partial, lid, nt);
  total = group_sum(total, partial, lid, nt);
  nans = group_sum(nans, partial, lid, nt);
  float s = 0.0f;
  for (long c = lid; c < v; c += nt) s += precise::exp(load(z, base + c, zc) - m);
  s = group_sum(s, partial, lid, nt);
  // a +inf logit: s is NaN (inf − inf), lse +inf; a NaN logit: NaN, also beside a +inf one.
  // lse = top + ls, subtracted term by term below: z − m is exact for the logits that matter, and
  // their float32 sum is up to 2^-11 off at logits near 1e4, an error every probability would carry
  float top = nans > 0.0f ? NAN : m;
  float ls = (nans > 0.0f || m == INFINITY) ? 0.0f : precise::log(s);
  float lse = top + ls;
  if (lid == 0) {
    float zt = in_range ? load(z, base + t, zc) : 0.0f;
    float loss = (1.0f - eps) * ((top - zt) + ls);
    if (eps > 0.0f) loss += eps * ((top - total / float(v > 0 ? v : 1)) + ls);
    losses[row] = kept ? (in_range ? loss : NAN) : 0.0f;
    lse_out[row] = lse;
  }
  if (!grad) return;
  float g = unit[row];
  for (long c = lid; c < v; c += nt) {
    float d = precise::exp((load(z, base + c, zc) - top) - ls) - (c == t ? 1.0f - eps : 0.0f) - eps / float(v);
    store(dz, base + c, dc, kept ? g * d : 0.0f);  // an ignored row's inf or NaN reaches nothing
  }
}

// dx = d · g[row] (per_row) or d · g[0]; a grid-stride loop. ip: n, row length, code, per_row
kernel void scale_rows(device const uchar* d [[buffer(0)]], device const float* g [[buffer(1)]],
                       device uchar* dx [[buffer(2)]], constant long* ip [[buffer(3)]],
                       uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0], width = ip[1];
  int xc = int(ip[2]);
  bool per_row = ip[3] != 0;
  for (long e = i; e < n; e += threads) store(dx, e, xc, load(d, e, xc) * g[per_row ? e / width : 0]);
}
