"""kpt attention against SDPA (cuDNN) forward+backward: the kernels each launches and their GPU time
(torch.profiler), at the sweep's worst shape (GQA 8, S8192, causal) and the perf shape."""
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from torch.nn.attention import SDPBackend, sdpa_kernel
import kpt
be = kpt.get_backend("cuda")
def sdpa(q, k, v, causal, scale):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
for (b, hq, hk, s, d, causal) in [(2, 32, 4, 8192, 128, True), (2, 32, 8, 8192, 128, True), (4, 32, 32, 4096, 128, False)]:
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    scale = d ** -0.5
    calls = {"kpt": lambda: be.attention(q, k, v, causal=causal, scale=scale),
             "SDPA cuDNN": lambda: sdpa(q, k, v, causal, scale)}
    for name, call in calls.items():
        o = call(); do = torch.randn_like(o)
        print(f"\nB{b} H{hq}/{hk} S{s} D{d} causal={causal} {name}: o strides {o.stride()}, do strides {do.stride()}")
        for _ in range(3):
            torch.autograd.grad(call(), (q, k, v), do)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.autograd.grad(call(), (q, k, v), do)
            torch.cuda.synchronize()
        total = 0.0
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total):
            if e.self_device_time_total <= 0:
                continue
            total += e.self_device_time_total / 5
            print(f"  {e.self_device_time_total / 5:9.1f} µs  x{e.count // 5:<3} {e.key[:110]}")
        print(f"  total {total:.1f} µs per fwd+bwd")
