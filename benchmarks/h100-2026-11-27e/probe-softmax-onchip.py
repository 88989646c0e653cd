"""Softmax forward held on chip (kpt-cuda) vs the portable Triton forward, eager and Liger; GPU time, L2 flushed."""
import torch
from torch.profiler import profile, ProfilerActivity
import kpt
from kpt.benchmark import libraries
from kpt_cuda import softmax as native
from kpt_triton import softmax as portable
be = kpt.get_backend("cuda")
params = dict(be.params("softmax_fwd"))
print("tuning", params)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def gpu_us(run, calls=10):
    run(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_(); run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if "FillFunctor" not in e.key) / calls
liger = libraries("softmax")[0].get("Liger")
print("| rows × D | dtype | kpt-cuda fwd | portable fwd | eager fwd | Liger fwd | × best | kpt fwd+bwd | eager fwd+bwd | Liger fwd+bwd |")
print("|---|---|---|---|---|---|---|---|---|---|")
for n, d, dt in [                 (4096, 128256, torch.bfloat16), (4096, 151936, torch.bfloat16), (4096, 152064, torch.float16),
                 (4096, 256000, torch.bfloat16), (2048, 50257, torch.float32), (4096, 32768, torch.bfloat16)]:
    x = torch.randn(n, d, device="cuda", dtype=dt)
    a = gpu_us(lambda: native.softmax_fwd(x, 1, **params))
    b = gpu_us(lambda: portable.softmax_fwd(x, 1, **params))
    e = gpu_us(lambda: torch.softmax(x, -1))
    try:
        l = gpu_us(lambda: liger(x, 1))
    except RuntimeError:
        l = float("nan")
    y1 = native.softmax_fwd(x, 1, **params)[0]; y2 = portable.softmax_fwd(x, 1, **params)[0]
    diff = (y1.float() - y2.float()).abs().max().item()
    xl = x.detach().requires_grad_(); g = torch.randn_like(x)
    fb = lambda f: gpu_us(lambda: torch.autograd.grad(f(xl), xl, g))
    kf = fb(lambda t: be.softmax(t, -1)); ef = fb(lambda t: torch.softmax(t, -1))
    lf = fb(lambda t: liger(t, 1)) if l == l else float("nan")
    best = min(e, l) if l == l else e
    print(f"| {n} × {d} | {str(dt)[6:]} | {a:.0f} | {b:.0f} | {e:.0f} | {l:.0f} | {best / a:.2f} | {kf:.0f} | {ef:.0f} | {lf:.0f} | max|Δy| {diff:.1e}", flush=True)
    del x, xl, g, y1, y2; torch.cuda.empty_cache()
