// Rotary position embedding (rotate-half), a grid-stride loop over the elements of one of q, k.
//   forward:  out = t · cos + rotate_half(t) · sin,   rotate_half([t₁, t₂]) = [−t₂, t₁]
//   backward: dt  = dout · cos − rotate_half(dout · sin)

// t: [B, H, S, D]; cos, sin: [S, D] or [B, S, D]. ip: n, D, S, H, per-sequence tables, dtype code, backward
kernel void rope(device const uchar* t [[buffer(0)]], device const uchar* cosines [[buffer(1)]],
                 device const uchar* sines [[buffer(2)]], device uchar* out [[buffer(3)]],
                 constant long* ip [[buffer(4)]], uint i [[thread_position_in_grid]],
                 uint threads [[threads_per_grid]]) {
  long n = ip[0], d = ip[1], s = ip[2], h = ip[3];
  bool per_sequence = ip[4] != 0, backward = ip[6] != 0;
  int xc = int(ip[5]);
  long half_d = d / 2;
  for (long e = i; e < n; e += threads) {
    long c = e % d, pos = (e / d) % s, b = e / (d * s * h);
    long row = (per_sequence ? b * s + pos : pos) * d;
    long partner = c < half_d ? c + half_d : c - half_d;
    float sign = c < half_d ? -1.0f : 1.0f;
    float v = load(t, e, xc) * load(cosines, row + c, xc);
    if (backward)
      v -= sign * load(t, e - c + partner, xc) * load(sines, row + partner, xc);
    else
      v += sign * load(t, e - c + partner, xc) * load(sines, row + c, xc);
    store(out, e, xc, v);
  }
}
