// The epilogues of linear around torch's matmul (float32 accumulation):
//   forward:  pre = acc + bias,  y = act(pre)        backward: dpre = dy · act'(pre)

// acc: float32 [rows, N]. ip: n, N, code of y/pre, code of bias (-1: none), activation, write pre
kernel void linear_epilogue(device const float* acc [[buffer(0)]], device const uchar* bias [[buffer(1)]],
                            device uchar* y [[buffer(2)]], device uchar* pre [[buffer(3)]],
                            constant long* ip [[buffer(4)]], uint i [[thread_position_in_grid]],
                            uint threads [[threads_per_grid]]) {
  long n = ip[0], cols = ip[1];
  int yc = int(ip[2]), bc = int(ip[3]), kind = int(ip[4]);
  bool keep_pre = ip[5] != 0;
  for (long e = i; e < n; e += threads) {
    float v = acc[e];
    if (bc >= 0) v += load(bias, e % cols, bc);
    store(y, e, yc, act(v, kind));
    if (keep_pre) store(pre, e, yc, v);
  }
}

// dpre (float32) = dy · act'(pre). ip: n, code of dy/pre, activation
kernel void linear_epilogue_bwd(device const uchar* pre [[buffer(0)]], device const uchar* dy [[buffer(1)]],
                                device float* dpre [[buffer(2)]], constant long* ip [[buffer(3)]],
                                uint i [[thread_position_in_grid]], uint threads [[threads_per_grid]]) {
  long n = ip[0];
  int yc = int(ip[1]), kind = int(ip[2]);
  for (long e = i; e < n; e += threads) dpre[e] = load(dy, e, yc) * act_grad(load(pre, e, yc), kind);
}
