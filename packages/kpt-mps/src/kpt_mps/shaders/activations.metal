// Pointwise activations and gated units, a grid-stride loop over the elements.
//   y = act(x) [· up];   dgate = dy · up · act'(gate),  dup = dy · act(gate)   (act: common.metal)

// ip: n, dtype code, activation kind, gated (up is read)
kernel void activation_fwd(device const uchar* x [[buffer(0)]], device const uchar* up [[buffer(1)]],
                           device uchar* y [[buffer(2)]], constant long* ip [[buffer(3)]],
                           uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0];
  int xc = int(ip[1]), kind = int(ip[2]);
  bool gated = ip[3] != 0;
  for (long e = i; e < n; e += threads) {
    float v = act(load(x, e, xc), kind);
    if (gated) v *= load(up, e, xc);
    store(y, e, xc, v);
  }
}

// ip: n, dtype code, activation kind, gated; writes dx (the gate's gradient) and, gated, dup
kernel void activation_bwd(device const uchar* x [[buffer(0)]], device const uchar* up [[buffer(1)]],
                           device const uchar* dy [[buffer(2)]], device uchar* dx [[buffer(3)]],
                           device uchar* dup [[buffer(4)]], constant long* ip [[buffer(5)]],
                           uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0];
  int xc = int(ip[1]), kind = int(ip[2]);
  bool gated = ip[3] != 0;
  for (long e = i; e < n; e += threads) {
    float g = load(x, e, xc), d = load(dy, e, xc);
    if (gated) {
      float u = load(up, e, xc);
      store(dx, e, xc, d * u * act_grad(g, kind));
      store(dup, e, xc, d * act(g, kind));
    } else {
      store(dx, e, xc, d * act_grad(g, kind));
    }
  }
}
