"""Softmax backward held on chip (kpt-cuda) vs the portable Triton backward, eager and Liger; GPU time, L2 flushed."""
import torch
from torch.profiler import profile, ProfilerActivity
import kpt
from kpt.benchmark import libraries
from kpt_cuda import softmax as native
from kpt_triton import softmax as portable
be = kpt.get_backend("cuda")
pb = dict(be.params("softmax_bwd")); pf = dict(be.params("softmax_fwd"))
print("tuning bwd", pb, "fwd", pf)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def gpu_us(run, calls=10):
    run(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_(); run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if "FillFunctor" not in e.key) / calls
liger = libraries("softmax")[0].get("Liger")
print("| rows × D | dtype | native bwd | portable bwd | eager bwd | bytes/µs native (GB/s, 3 transfers) | max rel Δ native vs portable | kpt fwd+bwd | eager fwd+bwd | Liger fwd+bwd |")
print("|---|---|---|---|---|---|---|---|---|---|")
for n, d, dt in [(4096, 16400, torch.bfloat16), (4096, 32000, torch.bfloat16), (4096, 32768, torch.bfloat16),
                 (4096, 50257, torch.bfloat16), (4096, 65536, torch.bfloat16), (4096, 128256, torch.bfloat16),
                 (4096, 151936, torch.bfloat16), (4096, 152064, torch.float16), (2048, 50257, torch.float32),
                 (8192, 32000, torch.bfloat16), (1024, 128256, torch.bfloat16), (132, 128256, torch.bfloat16)]:
    x = torch.randn(n, d, device="cuda", dtype=dt)
    y = torch.softmax(x.float(), -1).to(dt); dy = torch.randn_like(y)
    a = gpu_us(lambda: native.softmax_bwd(x, 1, y, dy, **pb))
    b = gpu_us(lambda: portable.softmax_bwd(x, 1, y, dy, **pb))
    yl = y.float().requires_grad_()
    e = gpu_us(lambda: torch._softmax_backward_data(dy, y, -1, dt))
    d1 = native.softmax_bwd(x, 1, y, dy, **pb)[0].float(); d2 = portable.softmax_bwd(x, 1, y, dy, **pb)[0].float()
    rel = ((d1 - d2).abs().max() / d2.abs().max()).item()
    xl = x.detach().requires_grad_(); g = torch.randn_like(x)
    fb = lambda f: gpu_us(lambda: torch.autograd.grad(f(xl), xl, g))
    kf = fb(lambda t: be.softmax(t, -1)); ef = fb(lambda t: torch.softmax(t, -1))
    try:
        lf = fb(lambda t: liger(t, 1))
    except Exception:
        lf = float("nan")
    gbs = 3 * n * d * x.element_size() / a / 1e3
    print(f"| {n} × {d} | {str(dt)[6:]} | {a:.0f} | {b:.0f} | {e:.0f} | {gbs:.0f} | {rel:.1e} | {kf:.0f} | {ef:.0f} | {lf:.0f} |", flush=True)
    del x, y, dy, xl, g, d1, d2, yl; torch.cuda.empty_cache()
