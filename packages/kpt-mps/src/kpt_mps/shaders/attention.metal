// Attention with grouped-query heads, a bottom-right causal mask and an optional boolean mask
// (kpt.kernels.attention's math): forward and backward tiled with 8×8 simdgroup_matrix products, one
// simdgroup (32 threads) per threadgroup; the forward with an online softmax, the backward from the
// forward's log-sum-exp. q: [B, Hq, Sq, D], k and v: [B, Hkv, Skv, D], query head h reads key/value
// head h / (Hq / Hkv); query i sees key j where j <= i + Skv − Sq (causal) and mask[b, h, i, j] is
// true (one byte per pair, read through its element strides: 0 on the dimensions it is broadcast
// over). A query that sees no key gives o = 0, lse = −∞, and zero gradients.
//
// ip of every kernel below but attention_last_nonfinite: B, Hq, Hkv, Sq, Skv, D, causal, dtype code,
// has_mask, then the mask's strides over B, Hq, Sq, Skv (without a mask the buffer is never read).
//
// Special values in the forward give what the reference's dense math gives: a NaN score makes its
// row's o and lse NaN; a +∞ score gives lse = +∞ and o = NaN (exp(∞ − ∞)); a key hidden by the
// causal mask never enters a score, but the reference's p·v still multiplies its v row by p = 0, so
// an ∞ or NaN there makes that column of o NaN for every query it is hidden from (those that see no
// key included). The forward never loads the key blocks past its queries' diagonal, so with a causal
// mask and more than one query, attention_last_nonfinite first records per column of v the last row
// holding an ∞ or NaN, and the forward's epilogue applies it.

constant int MAX_HEAD_DIM = 256;

// Whether the boolean mask lets query i of (batch b, query head h) see key j (true without a mask);
// i and j must lie within the sequences.
inline bool attention_allowed(device const uchar* mask, constant long* ip, long b, long h, long i, long j) {
  return ip[8] == 0 || mask[b * ip[9] + h * ip[10] + i * ip[11] + j * ip[12]] != 0;
}

// For each (batch, key/value head, column c) of v [B, Hkv, Skv, D]: the last row j whose v[j, c] is
// ±∞ or NaN, −1 if none (one thread per column, reading the rows from the end; a grid-stride loop).
// ip: B·Hkv·D, Skv, D, dtype code
kernel void attention_last_nonfinite(device const uchar* v [[buffer(0)]], device int* last [[buffer(1)]],
                                     constant long* ip [[buffer(2)]], uint tid [[thread_position_in_grid]],
                                     uint threads [[threads_per_grid]]) {
  long n = ip[0], skv = ip[1], d = ip[2];
  int xc = int(ip[3]);
  for (long e = tid; e < n; e += threads) {
    long base = e / d * skv * d + e % d;
    int found = -1;
    for (long j = skv - 1; j >= 0 && found < 0; --j) {
      if (!isfinite(load(v, base + j * d, xc))) found = int(j);
    }
    last[e] = found;
  }
}

// The forward: one simdgroup (32 threads) per block of 8 queries of one (batch, head). Over key
// blocks of 8: S = Q·Kᵀ as 8×8 simdgroup_matrix products over the head dimension (padded to a
// multiple of 8 with zeros), the online softmax on the score tile (a lane per query row), then
// O = O·correction + P·V, again by 8×8 products. Threadgroup memory: Q, the K then V tile, O
// (3 × 8 × 256 floats = 24 KB) and the score tile. The running max is subtracted only where it is
// finite: a row that has seen no key keeps m = −∞ (exp(−∞) = 0, not NaN), one that met a +∞ score
// gets m = +∞ and l = +∞ (lse = +∞; o = P·V / l is NaN, as the reference's exp(∞ − ∞)).
// A key the boolean mask hides is loaded and multiplied by p = 0, as in the reference's p·v.
// last_nonfinite: attention_last_nonfinite of v, [B, Hkv, D], read only when causal with Sq > 1.
// ip: as above; fp: scale
kernel void attention_fwd(device const uchar* q [[buffer(0)]], device const uchar* k [[buffer(1)]],
                          device const uchar* v [[buffer(2)]], device const int* last_nonfinite [[buffer(3)]],
                          device const uchar* mask [[buffer(4)]], device uchar* o [[buffer(5)]],
                          device float* lse [[buffer(6)]], constant long* ip [[buffer(7)]],
                          constant float* fp [[buffer(8)]],
                          uint blk [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
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
  long g = b * hkv + h / (hq / hkv), qbase = bh * sq * d, kv = g * skv * d;
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
        bool seen = i < sq && j0 + j <= last && j0 + j < skv && attention_allowed(mask, ip, b, h, i, j0 + j);
        sv[j] = seen ? sc * scale : -INFINITY;
        block_max = max(block_max, sv[j]);
      }
      float m_new = max(m, block_max);  // max drops NaN scores: their p below is NaN
      float m_sub = isfinite(m_new) ? m_new : 0.0f;
      float correction = precise::exp(m - m_sub);
      float sum = 0.0f;
      for (int j = 0; j < 8; ++j) {
        float p = precise::exp(sv[j] - m_sub);
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
  // l = 0: the query saw no key (m = −∞: lse = −∞, o = P·V = 0 unless an ∞ or NaN of v met p = 0);
  // a NaN l (a NaN score, or ∞ − ∞ after an overflowing score) makes o and lse NaN, as in the
  // reference's softmax. With the causal mask the reference's p·v meets the keys hidden from query
  // i with p = 0: an ∞ or NaN in a v row past i + Skv − Sq makes its column NaN (last_nonfinite).
  bool hidden_keys = causal && sq > 1;
  for (long e = lane; e < 8 * dp; e += 32) {
    long r = e / dp, c = e % dp, i = i0 + r;
    if (i < sq && c < d) {
      float l = stat[8 + r];
      float out = float(os[e]) / (l == 0.0f ? 1.0f : l);
      if (hidden_keys) {
        long j = last_nonfinite[g * d + c];
        if (j >= 0 && j > i + skv - sq) out = NAN;
      }
      store(o, qbase + i * d + c, xc, out);
    }
  }
  if (lane < 8 && i0 + lane < sq) {
    float m = stat[lane], l = stat[8 + lane];
    lse[bh * sq + i0 + lane] = m + precise::log(l);
  }
}

// Whether query i sees key j (the causal mask is bottom-right aligned); rows and columns of a tile
// past the end of the sequences see nothing.
inline bool attention_visible(long i, long j, long sq, long skv, bool causal) {
  return i < sq && j < skv && (!causal || j <= i + skv - sq);
}

// The log-sum-exp from which the backward recomputes p = exp(s·scale − lse): a query whose visible
// scores are all −∞ (or that sees no key) has lse = −∞, taken as +∞ so that its p is exactly 0, as
// the reference's, not exp(−∞ + ∞) = NaN.
inline float attention_backward_lse(float lse) {
  return lse == -INFINITY ? INFINITY : lse;
}

// The backward for dq: one simdgroup per block of 8 queries of one (batch, head), the row statistic
// delta = rowsum(dO ⊙ O) first (written for attention_bwd_dkv), then over key blocks of 8, with 8×8
// simdgroup_matrix products over the head dimension (padded to a multiple of 8 with zeros):
//   dP = dO·Vᵀ,  S = Q·Kᵀ,  P = exp(S·scale − lse) (0 where masked),  dS = P ⊙ (dP − delta),
//   dq += dS·K,  finally dq · scale.
// V is read before K so that one tile serves both. dq accumulates in float32 simdgroup matrices (one
// per 8 columns of the head dimension). Threadgroup memory: Q, dO, the V then K tile (3 × 8 × 256
// floats = 24 KB), the score tile (S, then P, then dS), the dP tile and the row statistics.
// ip, fp: as the forward's
kernel void attention_bwd_dq(device const uchar* q [[buffer(0)]], device const uchar* k [[buffer(1)]],
                             device const uchar* v [[buffer(2)]], device const uchar* o [[buffer(3)]],
                             device const float* lse [[buffer(4)]], device const uchar* dout [[buffer(5)]],
                             device const uchar* mask [[buffer(6)]], device float* delta [[buffer(7)]],
                             device uchar* dq [[buffer(8)]], constant long* ip [[buffer(9)]],
                             constant float* fp [[buffer(10)]],
                             uint blk [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float qs[8 * MAX_HEAD_DIM];
  threadgroup float dos[8 * MAX_HEAD_DIM];
  threadgroup float kvs[8 * MAX_HEAD_DIM];
  threadgroup float ss[64];
  threadgroup float dps[64];
  threadgroup float rows[16];  // per query row: lse, delta
  long hq = ip[1], hkv = ip[2], sq = ip[3], skv = ip[4], d = ip[5];
  bool causal = ip[6] != 0;
  int xc = int(ip[7]);
  float scale = fp[0];
  long dp = (d + 7) / 8 * 8, blocks = (sq + 7) / 8;
  long i0 = long(blk) % blocks * 8, bh = long(blk) / blocks, h = bh % hq, b = bh / hq;
  long qbase = bh * sq * d, kv = (b * hkv + h / (hq / hkv)) * skv * d;
  for (long e = lane; e < 8 * dp; e += 32) {
    long r = e / dp, c = e % dp;
    bool in = i0 + r < sq && c < d;
    qs[e] = in ? load(q, qbase + (i0 + r) * d + c, xc) : 0.0f;
    dos[e] = in ? load(dout, qbase + (i0 + r) * d + c, xc) : 0.0f;
  }
  if (lane < 8) {
    long i = i0 + lane;
    float stat = 0.0f, dl = 0.0f;
    if (i < sq) {
      for (long c = 0; c < d; ++c) dl += load(dout, qbase + i * d + c, xc) * load(o, qbase + i * d + c, xc);
      stat = attention_backward_lse(lse[bh * sq + i]);
      delta[bh * sq + i] = dl;
    }
    rows[lane] = stat;
    rows[8 + lane] = dl;
  }
  simdgroup_float8x8 dqm[MAX_HEAD_DIM / 8];
  for (long c = 0; c < dp; c += 8) dqm[c / 8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  long last_key = causal ? min(min(i0 + 7, sq - 1) + skv - sq, skv - 1) : skv - 1;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (long j0 = 0; j0 <= last_key; j0 += 8) {
    for (long e = lane; e < 8 * dp; e += 32) {
      long r = e / dp, c = e % dp;
      kvs[e] = (j0 + r < skv && c < d) ? load(v, kv + (j0 + r) * d + c, xc) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 am, bm;
    for (long c = 0; c < dp; c += 8) {
      simdgroup_load(am, dos + c, dp);
      simdgroup_load(bm, kvs + c, dp, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(acc, am, bm, acc);
    }
    simdgroup_store(acc, dps + 0, 8);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every lane has read V before K replaces it
    for (long e = lane; e < 8 * dp; e += 32) {
      long r = e / dp, c = e % dp;
      kvs[e] = (j0 + r < skv && c < d) ? load(k, kv + (j0 + r) * d + c, xc) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (long c = 0; c < dp; c += 8) {
      simdgroup_load(am, qs + c, dp);
      simdgroup_load(bm, kvs + c, dp, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(acc, am, bm, acc);
    }
    simdgroup_store(acc, ss + 0, 8);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(lane); e < 64; e += 32) {  // the tile's elements, two per lane
      long r = e / 8, j = e % 8;
      float s = ss[e], dpv = dps[e], stat = rows[r], dl = rows[8 + r];
      bool seen = attention_visible(i0 + r, j0 + j, sq, skv, causal) &&
                  attention_allowed(mask, ip, b, h, i0 + r, j0 + j);
      float p = seen ? precise::exp(s * scale - stat) : 0.0f;
      ss[e] = p * (dpv - dl);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_load(am, ss + 0, 8);
    for (long c = 0; c < dp; c += 8) {
      simdgroup_load(bm, kvs + c, dp);
      simdgroup_multiply_accumulate(dqm[c / 8], am, bm, dqm[c / 8]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K and dS are read before the next block
  }
  for (long c = 0; c < dp; c += 8) simdgroup_store(dqm[c / 8], qs + c, dp);  // staged through Q's tile
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (long e = lane; e < 8 * dp; e += 32) {
    long r = e / dp, c = e % dp;
    if (i0 + r < sq && c < d) store(dq, qbase + (i0 + r) * d + c, xc, float(qs[e]) * scale);
  }
}

// The backward for dk and dv: one simdgroup per block of 8 keys of one (batch, key/value head) g,
// over the query heads of g's group and their blocks of 8 queries that see a key of the block:
//   S = Q·Kᵀ,  P = exp(S·scale − lse) (0 where masked),  dP = dO·Vᵀ,  dv += Pᵀ·dO,
//   dS = P ⊙ (dP − delta),  dk += dSᵀ·Q,  finally dk · scale.
// Each simdgroup owns its keys' rows of dk and dv: no atomics. One tile holds Q, then dO, then Q
// again (read twice so that K, V and it fit 24 KB); dk and dv accumulate in float32 simdgroup
// matrices. delta comes from attention_bwd_dq.  ip, fp: as the forward's
kernel void attention_bwd_dkv(device const uchar* q [[buffer(0)]], device const uchar* k [[buffer(1)]],
                              device const uchar* v [[buffer(2)]], device const float* lse [[buffer(3)]],
                              device const uchar* dout [[buffer(4)]], device const float* delta [[buffer(5)]],
                              device const uchar* mask [[buffer(6)]], device uchar* dk [[buffer(7)]],
                              device uchar* dv [[buffer(8)]], constant long* ip [[buffer(9)]],
                              constant float* fp [[buffer(10)]],
                              uint blk [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float ks[8 * MAX_HEAD_DIM];
  threadgroup float vs[8 * MAX_HEAD_DIM];
  threadgroup float xs[8 * MAX_HEAD_DIM];
  threadgroup float ss[64];
  threadgroup float dps[64];
  threadgroup float rows[16];  // per query row: lse, delta
  long hq = ip[1], hkv = ip[2], sq = ip[3], skv = ip[4], d = ip[5];
  bool causal = ip[6] != 0;
  int xc = int(ip[7]);
  float scale = fp[0];
  long dp = (d + 7) / 8 * 8, blocks = (skv + 7) / 8, group = hq / hkv;
  long j0 = long(blk) % blocks * 8, bg = long(blk) / blocks, g = bg % hkv, b = bg / hkv;
  long kv = bg * skv * d;
  for (long e = lane; e < 8 * dp; e += 32) {
    long r = e / dp, c = e % dp;
    bool in = j0 + r < skv && c < d;
    ks[e] = in ? load(k, kv + (j0 + r) * d + c, xc) : 0.0f;
    vs[e] = in ? load(v, kv + (j0 + r) * d + c, xc) : 0.0f;
  }
  simdgroup_float8x8 dkm[MAX_HEAD_DIM / 8], dvm[MAX_HEAD_DIM / 8];
  for (long c = 0; c < dp; c += 8) {
    dkm[c / 8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    dvm[c / 8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  long first = causal ? max(j0 - (skv - sq), 0L) : 0;  // the first query that sees key j0
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (long h = g * group; h < (g + 1) * group; ++h) {
    long qrow = (b * hq + h) * sq;  // the index of the head's first query row
    for (long i0 = first; i0 < sq; i0 += 8) {
      for (long e = lane; e < 8 * dp; e += 32) {
        long r = e / dp, c = e % dp;
        xs[e] = (i0 + r < sq && c < d) ? load(q, (qrow + i0 + r) * d + c, xc) : 0.0f;
      }
      if (lane < 8) {
        bool in = i0 + lane < sq;
        rows[lane] = in ? attention_backward_lse(lse[qrow + i0 + lane]) : 0.0f;
        rows[8 + lane] = in ? delta[qrow + i0 + lane] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      simdgroup_float8x8 am, bm;
      for (long c = 0; c < dp; c += 8) {
        simdgroup_load(am, xs + c, dp);
        simdgroup_load(bm, ks + c, dp, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(acc, am, bm, acc);
      }
      simdgroup_store(acc, ss + 0, 8);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int e = int(lane); e < 64; e += 32) {  // the tile's elements, two per lane
        long r = e / 8, j = e % 8;
        float s = ss[e], stat = rows[r];
        bool seen = attention_visible(i0 + r, j0 + j, sq, skv, causal) &&
                    attention_allowed(mask, ip, b, h, i0 + r, j0 + j);
        ss[e] = seen ? precise::exp(s * scale - stat) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // P is written and every lane has read Q
      for (long e = lane; e < 8 * dp; e += 32) {
        long r = e / dp, c = e % dp;
        xs[e] = (i0 + r < sq && c < d) ? load(dout, (qrow + i0 + r) * d + c, xc) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (long c = 0; c < dp; c += 8) {
        simdgroup_load(am, xs + c, dp);
        simdgroup_load(bm, vs + c, dp, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(acc, am, bm, acc);
      }
      simdgroup_store(acc, dps + 0, 8);
      simdgroup_load(am, ss + 0, 8, ulong2(0, 0), true);  // Pᵀ
      for (long c = 0; c < dp; c += 8) {
        simdgroup_load(bm, xs + c, dp);
        simdgroup_multiply_accumulate(dvm[c / 8], am, bm, dvm[c / 8]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // dP is written and every lane has read dO and P
      for (int e = int(lane); e < 64; e += 32) {
        float p = ss[e], dpv = dps[e], dl = rows[8 + e / 8];
        ss[e] = p * (dpv - dl);
      }
      for (long e = lane; e < 8 * dp; e += 32) {
        long r = e / dp, c = e % dp;
        xs[e] = (i0 + r < sq && c < d) ? load(q, (qrow + i0 + r) * d + c, xc) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_load(am, ss + 0, 8, ulong2(0, 0), true);  // dSᵀ
      for (long c = 0; c < dp; c += 8) {
        simdgroup_load(bm, xs + c, dp);
        simdgroup_multiply_accumulate(dkm[c / 8], am, bm, dkm[c / 8]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // Q, dS and the statistics are read before the next block
    }
  }
  for (long c = 0; c < dp; c += 8) {  // staged through K's and V's tiles
    simdgroup_store(dkm[c / 8], ks + c, dp);
    simdgroup_store(dvm[c / 8], vs + c, dp);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (long e = lane; e < 8 * dp; e += 32) {
    long r = e / dp, c = e % dp;
    if (j0 + r < skv && c < d) {
      store(dk, kv + (j0 + r) * d + c, xc, float(ks[e]) * scale);
      store(dv, kv + (j0 + r) * d + c, xc, float(vs[e]));
    }
  }
}
