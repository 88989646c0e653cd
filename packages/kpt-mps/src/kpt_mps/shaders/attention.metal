// Attention with grouped-query heads and a bottom-right causal mask: one thread per query row
// (forward, dq) or key row (dk, dv), online softmax over the keys (kpt.kernels.attention's math).
// q: [B, Hq, Sq, D], k and v: [B, Hkv, Skv, D], query head h reads key/value head h / (Hq / Hkv);
// query i sees keys j <= i + Skv − Sq (causal). A query that sees no key gives o = 0, lse = −∞.

constant int MAX_HEAD_DIM = 256;

// ip: B, Hq, Hkv, Sq, Skv, D, causal, dtype code; fp: scale
kernel void attention_fwd(device const uchar* q [[buffer(0)]], device const uchar* k [[buffer(1)]],
                          device const uchar* v [[buffer(2)]], device uchar* o [[buffer(3)]],
                          device float* lse [[buffer(4)]], constant long* ip [[buffer(5)]],
                          constant float* fp [[buffer(6)]], uint idx [[thread_position_in_grid]]) {
  long hq = ip[1], hkv = ip[2], sq = ip[3], skv = ip[4], d = ip[5];
  bool causal = ip[6] != 0;
  int xc = int(ip[7]);
  if (long(idx) >= ip[0] * hq * sq) return;
  long i = long(idx) % sq, h = (long(idx) / sq) % hq, b = long(idx) / (sq * hq);
  long kv = (b * hkv + h / (hq / hkv)) * skv * d;
  long last = causal ? min(i + skv - sq, skv - 1) : skv - 1;
  float qv[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
  for (long c = 0; c < d; ++c) { qv[c] = load(q, long(idx) * d + c, xc); acc[c] = 0.0f; }
  float m = -INFINITY, l = 0.0f, scale = fp[0];
  for (long j = 0; j <= last; ++j) {
    float s = 0.0f;
    for (long c = 0; c < d; ++c) s += qv[c] * load(k, kv + j * d + c, xc);
    s *= scale;
    float m_new = max(m, s), correction = precise::exp(m - m_new), p = precise::exp(s - m_new);
    l = l * correction + p;
    for (long c = 0; c < d; ++c) acc[c] = acc[c] * correction + p * load(v, kv + j * d + c, xc);
    m = m_new;
  }
  for (long c = 0; c < d; ++c) store(o, long(idx) * d + c, xc, l > 0.0f ? acc[c] / l : 0.0f);
  lse[idx] = l > 0.0f ? m + precise::log(l) : -INFINITY;
}

// Thread per query row: delta = Σ dO · O, dq = scale · Σ_j p (dO · v_j − delta) k_j.
// ip, fp: as the forward's
kernel void attention_bwd_dq(device const uchar* q [[buffer(0)]], device const uchar* k [[buffer(1)]],
                             device const uchar* v [[buffer(2)]], device const uchar* o [[buffer(3)]],
                             device const float* lse [[buffer(4)]], device const uchar* dout [[buffer(5)]],
                             device float* delta [[buffer(6)]], device uchar* dq [[buffer(7)]],
                             constant long* ip [[buffer(8)]], constant float* fp [[buffer(9)]],
                             uint idx [[thread_position_in_grid]]) {
  long hq = ip[1], hkv = ip[2], sq = ip[3], skv = ip[4], d = ip[5];
  bool causal = ip[6] != 0;
  int xc = int(ip[7]);
  if (long(idx) >= ip[0] * hq * sq) return;
  long i = long(idx) % sq, h = (long(idx) / sq) % hq, b = long(idx) / (sq * hq);
  long kv = (b * hkv + h / (hq / hkv)) * skv * d, row = long(idx) * d;
  long last = causal ? min(i + skv - sq, skv - 1) : skv - 1;
  float qv[MAX_HEAD_DIM], dov[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
  float dl = 0.0f;
  for (long c = 0; c < d; ++c) {
    qv[c] = load(q, row + c, xc);
    dov[c] = load(dout, row + c, xc);
    dl += dov[c] * load(o, row + c, xc);
    acc[c] = 0.0f;
  }
  float scale = fp[0], stat = lse[idx];
  for (long j = 0; j <= last; ++j) {
    float s = 0.0f, dp = 0.0f;
    for (long c = 0; c < d; ++c) {
      s += qv[c] * load(k, kv + j * d + c, xc);
      dp += dov[c] * load(v, kv + j * d + c, xc);
    }
    float ds = precise::exp(s * scale - stat) * (dp - dl);
    for (long c = 0; c < d; ++c) acc[c] += ds * load(k, kv + j * d + c, xc);
  }
  for (long c = 0; c < d; ++c) store(dq, row + c, xc, acc[c] * scale);
  delta[idx] = dl;
}

// Thread per key row j of key/value head g: over the queries of every head in g's group that see j,
// dv = Σ p dO,  dk = scale · Σ p (dO · v_j − delta) q.  ip, fp: as the forward's
kernel void attention_bwd_dkv(device const uchar* q [[buffer(0)]], device const uchar* k [[buffer(1)]],
                              device const uchar* v [[buffer(2)]], device const float* lse [[buffer(3)]],
                              device const uchar* dout [[buffer(4)]], device const float* delta [[buffer(5)]],
                              device uchar* dk [[buffer(6)]], device uchar* dv [[buffer(7)]],
                              constant long* ip [[buffer(8)]], constant float* fp [[buffer(9)]],
                              uint idx [[thread_position_in_grid]]) {
  long hq = ip[1], hkv = ip[2], sq = ip[3], skv = ip[4], d = ip[5];
  bool causal = ip[6] != 0;
  int xc = int(ip[7]);
  if (long(idx) >= ip[0] * hkv * skv) return;
  long j = long(idx) % skv, g = (long(idx) / skv) % hkv, b = long(idx) / (skv * hkv), group = hq / hkv;
  long row = long(idx) * d;
  long first = causal ? max(j - (skv - sq), 0L) : 0;
  float kr[MAX_HEAD_DIM], vr[MAX_HEAD_DIM], dk_acc[MAX_HEAD_DIM], dv_acc[MAX_HEAD_DIM];
  for (long c = 0; c < d; ++c) {
    kr[c] = load(k, row + c, xc);
    vr[c] = load(v, row + c, xc);
    dk_acc[c] = 0.0f;
    dv_acc[c] = 0.0f;
  }
  float scale = fp[0];
  for (long h = g * group; h < (g + 1) * group; ++h) {
    for (long i = first; i < sq; ++i) {
      long qi = (b * hq + h) * sq + i, qrow = qi * d;
      float s = 0.0f, dp = 0.0f;
      for (long c = 0; c < d; ++c) {
        s += load(q, qrow + c, xc) * kr[c];
        dp += load(dout, qrow + c, xc) * vr[c];
      }
      float p = precise::exp(s * scale - lse[qi]);
      float ds = p * (dp - delta[qi]);
      for (long c = 0; c < d; ++c) {
        dv_acc[c] += p * load(dout, qrow + c, xc);
        dk_acc[c] += ds * load(q, qrow + c, xc);
      }
    }
  }
  for (long c = 0; c < d; ++c) {
    store(dk, row + c, xc, dk_acc[c] * scale);
    store(dv, row + c, xc, dv_acc[c]);
  }
}
