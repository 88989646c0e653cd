// Attention with grouped-query heads and a bottom-right causal mask (kpt.kernels.attention's math):
// the forward tiled with 8×8 simdgroup_matrix products and an online softmax; the backward one
// thread per query row (dq) or key row (dk, dv).
// q: [B, Hq, Sq, D], k and v: [B, Hkv, Skv, D], query head h reads key/value head h / (Hq / Hkv);
// query i sees keys j <= i + Skv − Sq (causal). A query that sees no key gives o = 0, lse = −∞.

constant int MAX_HEAD_DIM = 256;

// The forward: one simdgroup (32 threads) per block of 8 queries of one (batch, head). Over key
// blocks of 8: S = Q·Kᵀ as 8×8 simdgroup_matrix products over the head dimension (padded to a
// multiple of 8 with zeros), the online softmax on the score tile (a lane per query row), then
// O = O·correction + P·V, again by 8×8 products. Threadgroup memory: Q, the K then V tile, O
// (3 × 8 × 256 floats = 24 KB) and the score tile.
// ip: B, Hq, Hkv, Sq, Skv, D, causal, dtype code; fp: scale
kernel void attention_fwd(device const uchar* q [[buffer(0)]], device const uchar* k [[buffer(1)]],
                          device const uchar* v [[buffer(2)]], device uchar* o [[buffer(3)]],
                          device float* lse [[buffer(4)]], constant long* ip [[buffer(5)]],
                          constant float* fp [[buffer(6)]], uint blk [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float qs[8 * MAX_HEAD_DIM];
  threadgroup float kvs[8 * MAX_HEAD_DIM];
  threadgroup float os[8 * MAX_HEAD_DIM];
  threadgroup float ss[64];
  threadgroup float stat[24];  // per query row: running max, running sum, this block's correction
  long hq = ip[1], hkv = ip[2], sq = ip[3], skv = ip[4], d = ip[5];
  bool causal = ip[6] != 0;
  int xc = int(ip[7]);
  float scale = fp[0];
  long dp = (d + 7) / 8 * 8, blocks = (sq + 7) / 8;
  long i0 = long(blk) % blocks * 8, bh = long(blk) / blocks, h = bh % hq, b = bh / hq;
  long qbase = bh * sq * d, kv = (b * hkv + h / (hq / hkv)) * skv * d;
  for (long e = lane; e < 8 * dp; e += 32) {
    long r = e / dp, c = e % dp;
    qs[e] = (i0 + r < sq && c < d) ? load(q, qbase + (i0 + r) * d + c, xc) : 0.0f;
    os[e] = 0.0f;
  }
  if (lane < 8) { stat[lane] = -INFINITY; stat[8 + lane] = 0.0f; }
  long last_key = causal ? min(min(i0 + 7, sq - 1) + skv - sq, skv - 1) : skv - 1;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (long j0 = 0; j0 <= last_key; j0 += 8) {
    for (long e = lane; e < 8 * dp; e += 32) {
      long r = e / dp, c = e % dp;
      kvs[e] = (j0 + r < skv && c < d) ? load(k, kv + (j0 + r) * d + c, xc) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 qm, km;
    for (long c = 0; c < dp; c += 8) {
      simdgroup_load(qm, qs + c, dp);
      simdgroup_load(km, kvs + c, dp, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(acc, qm, km, acc);
    }
    simdgroup_store(acc, ss + 0, 8);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (long e = lane; e < 8 * dp; e += 32) {
      long r = e / dp, c = e % dp;
      kvs[e] = (j0 + r < skv && c < d) ? load(v, kv + (j0 + r) * d + c, xc) : 0.0f;
    }
    if (lane < 8) {
      long i = i0 + lane, last = causal ? i + skv - sq : skv - 1;
      float sv[8];
      float m = stat[lane], block_max = -INFINITY;
      for (int j = 0; j < 8; ++j) {
        float sc = ss[lane * 8 + j];
        sv[j] = (i < sq && j0 + j <= last && j0 + j < skv) ? sc * scale : -INFINITY;
        block_max = max(block_max, sv[j]);
      }
      float m_new = max(m, block_max);
      float correction = m_new == -INFINITY ? 1.0f : precise::exp(m - m_new);
      float sum = 0.0f;
      for (int j = 0; j < 8; ++j) {
        float p = sv[j] == -INFINITY ? 0.0f : precise::exp(sv[j] - m_new);
        ss[lane * 8 + j] = p;
        sum += p;
      }
      float running = stat[8 + lane];
      stat[lane] = m_new;
      stat[8 + lane] = running * correction + sum;
      stat[16 + lane] = correction;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (long e = lane; e < 8 * dp; e += 32) os[e] = float(os[e]) * float(stat[16 + e / dp]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 pm, vm, om;
    simdgroup_load(pm, ss + 0, 8);
    for (long c = 0; c < dp; c += 8) {
      simdgroup_load(om, os + c, dp);
      simdgroup_load(vm, kvs + c, dp);
      simdgroup_multiply_accumulate(om, pm, vm, om);
      simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane has read the tile before it is overwritten
      simdgroup_store(om, os + c, dp);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (long e = lane; e < 8 * dp; e += 32) {
    long r = e / dp, c = e % dp;
    if (i0 + r < sq && c < d) {
      float l = stat[8 + r];
      store(o, qbase + (i0 + r) * d + c, xc, l > 0.0f ? float(os[e]) / l : 0.0f);
    }
  }
  if (lane < 8 && i0 + lane < sq) {
    float l = stat[8 + lane];
    lse[bh * sq + i0 + lane] = l > 0.0f ? float(stat[lane]) + precise::log(l) : -INFINITY;
  }
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
