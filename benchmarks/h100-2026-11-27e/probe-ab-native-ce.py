"""A/B: the native cross-entropy kernel before and after the head/tail change, aligned widths (GPU time, L2 flushed)."""
# old_ce: kpt_cuda/cross_entropy.py of commit 9419647, with `from kpt_cuda import device` and its
# kernel source read from a copy of that commit's cross_entropy.cu, on sys.path beside this file.
import sys, torch
sys.path.insert(0, sys.path[0])
from torch.profiler import profile, ProfilerActivity
import old_ce
from kpt_cuda import cross_entropy as new_ce
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def gpu_us(run, calls=10):
    run(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_(); run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if "FillFunctor" not in e.key) / calls
print("| N × V | dtype | old kernel µs | new kernel µs | new/old | same result |")
print("|---|---|---|---|---|---|")
for n, v, dt in [(8192, 50304, torch.bfloat16), (8192, 32000, torch.bfloat16), (8192, 128256, torch.bfloat16),
                 (4096, 151936, torch.bfloat16), (8192, 32768, torch.float16), (4096, 65536, torch.float32)]:
    z = torch.randn(n, v, device="cuda", dtype=dt); t = torch.randint(0, v, (n,), device="cuda")
    fo = lambda: old_ce.cross_entropy_fwd(z, t, -100, 0.0, "mean", True)
    fn = lambda: new_ce.cross_entropy_fwd(z, t, -100, 0.0, "mean", True)
    lo, go = fo(); ln, gn = fn()
    same = torch.equal(go, gn) and torch.equal(lo, ln)
    ts = {"old": [], "new": []}
    for _ in range(3):
        ts["old"].append(gpu_us(fo)); ts["new"].append(gpu_us(fn))
    a, b = min(ts["old"]), min(ts["new"])
    print(f"| {n} × {v} | {str(dt)[6:]} | {a:.0f} | {b:.0f} | {b / a:.3f} | {same} |", flush=True)
    del z; torch.cuda.empty_cache()
