"""Attention perf shape fwd+bwd, fp16 and bf16: the kernels of kpt and of SDPA's cuDNN, GPU time each."""
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.profiler import profile, ProfilerActivity
import kpt
be = kpt.get_backend("cuda")
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

def kernels(run, calls=5):
    run(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_(); run()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / calls, e.count // calls) for e in prof.key_averages()
            if e.self_device_time_total > 0 and "FillFunctor" not in e.key]
    return sorted(rows, key=lambda r: -r[1])

for dtype in (torch.float16, torch.bfloat16):
    for causal in (False, True):
        q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn(4, 32, 4096, 128, device="cuda", dtype=dtype)
        def kpt_run():
            o = be.attention(q, k, v, causal=causal)
            return torch.autograd.grad(o, (q, k, v), do)
        def sdpa_run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return torch.autograd.grad(o, (q, k, v), do)
        for name, run in (("kpt", kpt_run), ("sdpa-cudnn", sdpa_run)):
            ks = [kernels(run) for _ in range(3)]
            tot = [sum(r[1] for r in k_) for k_ in ks]
            print(f"## {str(dtype)[6:]} causal={causal} {name}: total GPU µs per call (3 rounds) {[round(t) for t in tot]}")
            for key, us, cnt in ks[-1]:
                print(f"    {us:9.1f} µs  x{cnt}  {key[:150]}")
        ga = kpt_run(); gb = sdpa_run()
        print("   max |Δ| grads kpt vs sdpa:", [float((a - b).abs().max()) for a, b in zip(ga, gb)], flush=True)
