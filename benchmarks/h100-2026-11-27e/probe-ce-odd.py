"""Native cross-entropy at odd vocabularies: GPU time (profiler, L2 flushed) vs the portable path and Liger."""
import sys, torch, functools
from torch.profiler import profile, ProfilerActivity
import kpt
from kpt_cuda import cross_entropy as native
from kpt.benchmark import libraries

be = kpt.get_backend("cuda")
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

def gpu_us(run, calls=10):
    run(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if "FillFunctor" not in e.key) / calls

def fwdbwd(fn, z, t):
    zl = z.detach().requires_grad_()
    def run():
        loss = fn(zl, t)
        (g,) = torch.autograd.grad(loss, zl)
        return g
    return run

found, _ = libraries("cross_entropy")
print("libraries:", list(found))
liger = found.get("Liger")
print("| N × V | kpt native | kpt portable | Liger | eager | native × liger | split |")
print("|---|---|---|---|---|---|---|")
for n, v in [(8192, 50257), (8192, 32001), (4096, 50257), (8192, 50304), (8192, 32000), (8192, 128256), (4096, 151936), (4096, 151937)]:
    z = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    kp = lambda zl, t: be.cross_entropy(zl, t)
    split = native.onchip_split(z, torch.cuda.get_device_properties().shared_memory_per_block_optin)
    a = gpu_us(fwdbwd(kp, z, t))
    g_native = fwdbwd(kp, z, t)()
    old = native.ONCHIP_MIN_V
    native.ONCHIP_MIN_V = 1 << 40
    b = gpu_us(fwdbwd(kp, z, t))
    g_port = fwdbwd(kp, z, t)()
    native.ONCHIP_MIN_V = old
    diff = (g_native.float() - g_port.float()).abs().max().item()
    if liger is not None:
        lf = lambda zl, t: liger(zl, t, -100, 0.0, "mean")
        try:
            c = gpu_us(fwdbwd(lf, z, t))
        except Exception as e:
            print("liger failed", e); c = float("nan")
    else:
        c = float("nan")
    e = gpu_us(fwdbwd(lambda zl, t: torch.nn.functional.cross_entropy(zl, t), z, t))
    print(f"| {n} × {v} | {a:.0f} | {b:.0f} | {c:.0f} | {e:.0f} | {c / a:.2f} | {split} | max|Δg| native−portable {diff:.2e}", flush=True)
    del z
    torch.cuda.empty_cache()
