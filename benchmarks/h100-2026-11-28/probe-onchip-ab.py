"""The on-chip kernels with the shared load helpers (new) against the committed source (head): GPU µs, L2 flushed,
and their outputs bit for bit; then the host time of a one-token linear."""
import functools, subprocess, time
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from importlib import resources
import kpt
from kpt_cuda import onchip, softmax as native, cross_entropy as nce
be = kpt.get_backend("cuda")
pf, pb = dict(be.params("softmax_fwd")), dict(be.params("softmax_bwd"))
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def gpu_us(run, calls=10):
    run(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_(); run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if "FillFunctor" not in e.key) / calls
# "head": the source before the shared load helpers (commit 3eb6aee); "new": the installed one
head = subprocess.run(["git", "show", "3eb6aee:packages/kpt-cuda/src/kpt_cuda/onchip.cu"], capture_output=True, text=True, check=True)
sources = {"new": resources.files("kpt_cuda").joinpath("onchip.cu").read_text(), "head": head.stdout}
@functools.cache
def kernel(version, name, smem_vecs, index):
    import cupy
    with cupy.cuda.Device(index):
        k = cupy.RawModule(code=sources[version], options=("-std=c++17",), name_expressions=(name,)).get_function(name)
        k.max_dynamic_shared_size_bytes = smem_vecs * onchip.THREADS * 16
    return k
which = ["new"]
onchip._kernel = lambda name, smem, index: kernel(which[0], name, smem, index)
print("| rows × V | dtype | call | head µs | new µs | bitwise equal |")
print("|---|---|---|---|---|---|")
for n, d, dt in [(4096, 50257, torch.bfloat16), (4096, 128256, torch.bfloat16), (4096, 151936, torch.bfloat16),
                 (4096, 152064, torch.float16), (2048, 50257, torch.float32)]:
    x = torch.randn(n, d, device="cuda", dtype=dt)
    y = torch.softmax(x.float(), -1).to(dt); dy = torch.randn_like(y); t = torch.randint(0, d, (n,), device="cuda")
    calls = {"softmax fwd": lambda: native.softmax_fwd(x, 1, **pf),
             "softmax bwd": lambda: native.softmax_bwd(x, 1, y, dy, **pb),
             "cross_entropy fwd+grad": lambda: nce.cross_entropy_fwd(x, t, -100, 0.0, "mean", True)}
    for name, run in calls.items():
        tm, out = {}, {}
        for v in ("head", "new", "head", "new"):
            which[0] = v
            tm.setdefault(v, []).append(gpu_us(run))
            out[v] = [o.clone() for o in run()]
        same = all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in zip(out["head"], out["new"]))
        print(f"| {n} × {d} | {str(dt)[6:]} | {name} | {min(tm['head']):.0f} | {min(tm['new']):.0f} | {same} |", flush=True)
    del x, y, dy; torch.cuda.empty_cache()
which[0] = "new"

# host time of a one-token linear (as a decode step calls it), µs per call back to back
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
dy = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
def host(run, n=2000):
    for _ in range(50): run()
    torch.cuda.synchronize(); best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): run()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best
rows = {
    "empty torch op (x.add_(0) )": lambda: x.add_(0),
    "kpt linear silu fwd": lambda: be.linear(x, w, None, activation="silu"),
    "F.linear + F.silu fwd": lambda: F.silu(F.linear(x, w)),
    "kpt linear silu fwd+bwd": lambda: torch.autograd.grad(be.linear(xg, wg, None, activation="silu"), (xg, wg), dy),
    "F.linear + F.silu fwd+bwd": lambda: torch.autograd.grad(F.silu(F.linear(xg, wg)), (xg, wg), dy),
    "kpt linear fwd (no act)": lambda: be.linear(x, w, None),
    "F.linear fwd": lambda: F.linear(x, w),
    "kpt rms_norm fwd": lambda: be.rms_norm(x, w[0]),
    "F.rms_norm fwd": lambda: F.rms_norm(x, (4096,), w[0], 1e-6),
}
print("\n| call (1 × 4096 → 14336 bf16) | host µs |\n|---|---|")
for k, r in rows.items():
    print(f"| {k} | {host(r):.1f} |", flush=True)
