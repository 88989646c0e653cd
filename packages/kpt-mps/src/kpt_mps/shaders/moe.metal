// Mixture-of-experts routing: top-k gating, dispatch (a stable counting sort by expert), combine.
// Index values out of range get the contract's defined results (kpt.kernels.moe): a pair routed
// outside [0, E) sorts after every expert; an order value outside [0, P) names no pair; of rows
// naming one pair the last wins.

// One threadgroup per token: p = softmax(z); the k largest logits (NaN largest; equal logits: lower
// expert first), weights = p[indices] (/ their sum when renormalizing). ip: E, k, code of z, renormalize
kernel void moe_gating_fwd(device const uchar* z [[buffer(0)]], device float* weights [[buffer(1)]],
                           device int* indices [[buffer(2)]], constant long* ip [[buffer(3)]],
                           uint token [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                           uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long e_count = ip[0], k = ip[1], base = long(token) * e_count;
  int zc = int(ip[2]);
  float m = -INFINITY;
  for (long c = lid; c < e_count; c += nt) m = max(m, load(z, base + c, zc));
  m = group_max(m, partial, lid, nt);
  float s = 0.0f;
  for (long c = lid; c < e_count; c += nt) s += precise::exp(load(z, base + c, zc) - m);
  s = group_sum(s, partial, lid, nt);
  // The order of the picks is the reference's stable descending sort: NaN first (as torch.topk
  // ranks it), then value descending; equal values (NaNs among themselves) by index ascending.
  float prev = NAN;  // the previous pick; NaN with index -1 before the first: every logit ranks after it
  long prev_index = -1;
  float total = 0.0f;
  for (long j = 0; j < k; ++j) {
    // this thread's first logit in that order after the previous pick
    float best = -INFINITY;
    long best_index = e_count;
    for (long c = lid; c < e_count; c += nt) {
      float v = load(z, base + c, zc);
      bool after = isnan(prev) ? (!isnan(v) || c > prev_index) : (!isnan(v) && (v < prev || (v == prev && c > prev_index)));
      bool before_best = best_index == e_count || (isnan(v) ? !isnan(best) : (!isnan(best) && v > best));
      if (after && before_best) { best = v; best_index = c; }
    }
    bool found = best_index < e_count;
    // group_max drops NaNs (Metal's max does): whether a thread holds a NaN is reduced on its own
    bool nan_top = group_max(found && isnan(best) ? 1.0f : 0.0f, partial, lid, nt) > 0.0f;
    float top = nan_top ? NAN : group_max(found ? best : -INFINITY, partial, lid, nt);
    bool at_top = found && (nan_top ? isnan(best) : best == top);
    float first = -group_max(at_top ? -float(best_index) : -INFINITY, partial, lid, nt);
    prev = top;
    prev_index = long(first);
    float p = precise::exp(top - m) / s;
    total += p;
    if (lid == 0) { weights[token * k + j] = p; indices[token * k + j] = int(prev_index); }
  }
  if (ip[3] != 0 && lid == 0)
    for (long j = 0; j < k; ++j) weights[token * k + j] = weights[token * k + j] / total;
}

// One threadgroup per token. renormalize: dz = scatter(w · (dw − Σ dw · w));
// else dz = p · (dp − Σ dp · p), dp = scatter(dw). ip: E, k, code of z, renormalize
kernel void moe_gating_bwd(device const uchar* z [[buffer(0)]], device const float* weights [[buffer(1)]],
                           device const int* indices [[buffer(2)]], device const float* dw [[buffer(3)]],
                           device uchar* dz [[buffer(4)]], constant long* ip [[buffer(5)]],
                           uint token [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                           uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long e_count = ip[0], k = ip[1], base = long(token) * e_count, pairs = long(token) * k;
  int zc = int(ip[2]);
  bool renormalize = ip[3] != 0;
  float m = -INFINITY;
  for (long c = lid; c < e_count; c += nt) m = max(m, load(z, base + c, zc));
  m = group_max(m, partial, lid, nt);
  float s = 0.0f;
  for (long c = lid; c < e_count; c += nt) s += precise::exp(load(z, base + c, zc) - m);
  s = group_sum(s, partial, lid, nt);
  float dot = 0.0f;  // Σ dw · w (renormalize) or Σ dp · p
  for (long j = 0; j < k; ++j)
    dot += dw[pairs + j] * (renormalize ? weights[pairs + j] : precise::exp(load(z, base + indices[pairs + j], zc) - m) / s);
  for (long c = lid; c < e_count; c += nt) {
    float g = 0.0f;
    if (renormalize) {
      for (long j = 0; j < k; ++j)
        if (indices[pairs + j] == c) g += weights[pairs + j] * (dw[pairs + j] - dot);
    } else {
      float dp = 0.0f;
      for (long j = 0; j < k; ++j)
        if (indices[pairs + j] == c) dp += dw[pairs + j];
      g = precise::exp(load(z, base + c, zc) - m) / s * (dp - dot);
    }
    store(dz, base + c, zc, g);
  }
}

inline long expert_key(int e, long experts) { return (e >= 0 && long(e) < experts) ? long(e) : experts; }

// Thread per pair: its row in the stable sort by expert. ip: P, E
kernel void moe_dispatch_order(device const int* indices [[buffer(0)]], device int* order [[buffer(1)]],
                               constant long* ip [[buffer(2)]], uint p [[thread_position_in_grid]]) {
  long pairs = ip[0], experts = ip[1];
  if (long(p) >= pairs) return;
  long key = expert_key(indices[p], experts), rank = 0;
  for (long q = 0; q < pairs; ++q) {
    long other = expert_key(indices[q], experts);
    rank += (other < key || (other == key && q < long(p))) ? 1 : 0;
  }
  order[rank] = int(p);
}

// Thread per expert boundary e in [0, E]: offsets[e] = pairs routed to experts below e. ip: P, E
kernel void moe_dispatch_offsets(device const int* indices [[buffer(0)]], device int* offsets [[buffer(1)]],
                                 constant long* ip [[buffer(2)]], uint e [[thread_position_in_grid]]) {
  long pairs = ip[0], experts = ip[1];
  if (long(e) > experts) return;
  int count = 0;
  for (long q = 0; q < pairs; ++q) count += expert_key(indices[q], experts) < long(e) ? 1 : 0;
  offsets[e] = count;
}

// out[r, :] = x[order[r] / k, :]. ip: n = P·H, H, k, code
kernel void moe_gather(device const uchar* x [[buffer(0)]], device const int* order [[buffer(1)]],
                       device uchar* out [[buffer(2)]], constant long* ip [[buffer(3)]],
                       uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0], width = ip[1], k = ip[2];
  int xc = int(ip[3]);
  for (long e = i; e < n; e += threads) store(out, e, xc, load(x, long(order[e / width]) / k * width + e % width, xc));
}

// Thread per pair: the last row r with order[r] == p, or -1. ip: P
kernel void moe_row_of_pair(device const int* order [[buffer(0)]], device int* rows [[buffer(1)]],
                            constant long* ip [[buffer(2)]], uint p [[thread_position_in_grid]]) {
  long pairs = ip[0];
  if (long(p) >= pairs) return;
  int found = -1;
  for (long r = pairs - 1; r >= 0 && found < 0; --r)
    if (long(order[r]) == long(p)) found = int(r);
  rows[p] = found;
}

// y[t, h] = Σ_slot w[t, slot] · rows_in[row_of_pair[t·k + slot], h] (w = 1 when absent: dispatch's
// backward). ip: n = T·H, H, k, code of rows_in/y, code of w (-1: none)
kernel void moe_combine_fwd(device const uchar* rows_in [[buffer(0)]], device const int* row_of_pair [[buffer(1)]],
                            device const uchar* w [[buffer(2)]], device uchar* y [[buffer(3)]],
                            constant long* ip [[buffer(4)]],
                            uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0], width = ip[1], k = ip[2];
  int yc = int(ip[3]), wc = int(ip[4]);
  for (long e = i; e < n; e += threads) {
    long t = e / width, h = e % width;
    float acc = 0.0f;
    for (long slot = 0; slot < k; ++slot) {
      int r = row_of_pair[t * k + slot];
      if (r >= 0) acc += (wc >= 0 ? load(w, t * k + slot, wc) : 1.0f) * load(rows_in, long(r) * width + h, yc);
    }
    store(y, e, yc, acc);
  }
}

// Thread per pair: dw[pair] = Σ_h dy[t, h] · y_sorted[row_of_pair[pair], h]. ip: P, H, k, code of y, code of w
kernel void moe_combine_dweights(device const uchar* y_sorted [[buffer(0)]], device const int* row_of_pair [[buffer(1)]],
                                 device const uchar* dy [[buffer(2)]], device uchar* dw [[buffer(3)]],
                                 constant long* ip [[buffer(4)]], uint p [[thread_position_in_grid]]) {
  long pairs = ip[0], width = ip[1], k = ip[2];
  int yc = int(ip[3]), wc = int(ip[4]);
  if (long(p) >= pairs) return;
  int r = row_of_pair[p];
  float acc = 0.0f;
  if (r >= 0)
    for (long h = 0; h < width; ++h) acc += load(dy, long(p) / k * width + h, yc) * load(y_sorted, long(r) * width + h, yc);
  store(dw, p, wc, acc);
}

// dy_sorted[r, h] = w[order[r]] · dy[order[r] / k, h] where row r is the row its pair reads, else 0.
// ip: n = P·H, H, k, P, code of dy, code of w
kernel void moe_combine_dy_sorted(device const int* order [[buffer(0)]], device const int* row_of_pair [[buffer(1)]],
                                  device const uchar* w [[buffer(2)]], device const uchar* dy [[buffer(3)]],
                                  device uchar* out [[buffer(4)]], constant long* ip [[buffer(5)]],
                                  uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0], width = ip[1], k = ip[2], pairs = ip[3];
  int yc = int(ip[4]), wc = int(ip[5]);
  for (long e = i; e < n; e += threads) {
    long r = e / width, p = long(order[r]);
    bool reads = p >= 0 && p < pairs && long(row_of_pair[p]) == r;
    store(out, e, yc, reads ? load(w, p, wc) * load(dy, p / k * width + e % width, yc) : 0.0f);
  }
}
