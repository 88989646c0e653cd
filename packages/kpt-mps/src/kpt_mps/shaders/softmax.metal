// Softmax over the last dimension of [rows, D] (the launcher moves the softmax dimension last),
// one threadgroup per row.   y = exp(x − max) / Σ exp(x − max);   dx = y · (dy − Σ dy · y)

// ip: D, dtype code
kernel void softmax_fwd(device const uchar* x [[buffer(0)]], device uchar* y [[buffer(1)]],
                        constant long* ip [[buffer(2)]],
                        uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                        uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long d = ip[0], base = long(row) * d;
  int xc = int(ip[1]);
  float m = -INFINITY;
  for (long c = lid; c < d; c += nt) m = max(m, load(x, base + c, xc));
  m = group_max(m, partial, lid, nt);
  float s = 0.0f;
  for (long c = lid; c < d; c += nt) s += precise::exp(load(x, base + c, xc) - m);
  s = group_sum(s, partial, lid, nt);
  for (long c = lid; c < d; c += nt) store(y, base + c, xc, precise::exp(load(x, base + c, xc) - m) / s);
}

// ip: D, dtype code
kernel void softmax_bwd(device const uchar* y [[buffer(0)]], device const uchar* dy [[buffer(1)]],
                        device uchar* dx [[buffer(2)]], constant long* ip [[buffer(3)]],
                        uint row [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                        uint nt [[threads_per_threadgroup]]) {
  threadgroup float partial[32];
  long d = ip[0], base = long(row) * d;
  int xc = int(ip[1]);
  float dot = 0.0f;
  for (long c = lid; c < d; c += nt) dot += load(y, base + c, xc) * load(dy, base + c, xc);
  dot = group_sum(dot, partial, lid, nt);
  for (long c = lid; c < d; c += nt) {
    float v = load(y, base + c, xc);
    store(dx, base + c, xc, v * (load(dy, base + c, xc) - dot));
  }
}
