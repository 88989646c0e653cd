"""Softmax backward on chip: pass B in the order pass A read dy (v1, committed) against the reverse order (v2)."""
import functools, sys
import torch
from torch.profiler import profile, ProfilerActivity
from importlib import resources
import kpt
from kpt_cuda import onchip, softmax as native
from kpt_triton import softmax as portable
be = kpt.get_backend("cuda")
pb = dict(be.params("softmax_bwd"))
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def gpu_us(run, calls=10):
    run(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_(); run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if "FillFunctor" not in e.key) / calls
sources = {"v2": resources.files("kpt_cuda").joinpath("onchip.cu").read_text(), "v1": open("onchip_v1.cu").read()  # the first version, saved beside this probe}
@functools.cache
def kernel(version, name, smem_vecs, index):
    import cupy
    with cupy.cuda.Device(index):
        k = cupy.RawModule(code=sources[version], options=("-std=c++17",), name_expressions=(name,)).get_function(name)
        k.max_dynamic_shared_size_bytes = smem_vecs * onchip.THREADS * 16
    return k
which = ["v2"]
onchip._kernel = lambda name, smem, index: kernel(which[0], name, smem, index)
print("| rows × D | dtype | v1 | v2 | portable | v2 GB/s (3 transfers) | v2 max rel Δ vs portable |")
print("|---|---|---|---|---|---|---|")
for n, d, dt in [(4096, 50257, torch.bfloat16), (4096, 65536, torch.bfloat16), (4096, 128256, torch.bfloat16),
                 (4096, 151936, torch.bfloat16), (4096, 152064, torch.float16), (2048, 50257, torch.float32),
                 (8192, 32000, torch.bfloat16), (4096, 32768, torch.bfloat16), (8192, 128256, torch.bfloat16)]:
    x = torch.randn(n, d, device="cuda", dtype=dt)
    y = torch.softmax(x.float(), -1).to(dt); dy = torch.randn_like(y)
    native.BACKWARD_MIN_WIDTH = 0
    t = {}
    for v in ("v1", "v2", "v1", "v2"):
        which[0] = v
        t.setdefault(v, []).append(gpu_us(lambda: native.softmax_bwd(x, 1, y, dy, **pb)))
    b = gpu_us(lambda: portable.softmax_bwd(x, 1, y, dy, **pb))
    which[0] = "v2"
    d1 = native.softmax_bwd(x, 1, y, dy, **pb)[0].float(); d2 = portable.softmax_bwd(x, 1, y, dy, **pb)[0].float()
    rel = ((d1 - d2).abs().max() / d2.abs().max()).item()
    a1, a2 = min(t["v1"]), min(t["v2"])
    print(f"| {n} × {d} | {str(dt)[6:]} | {a1:.0f} | {a2:.0f} | {b:.0f} | {3 * n * d * x.element_size() / a2 / 1e3:.0f} | {rel:.1e} |", flush=True)
    del x, y, dy, d1, d2; torch.cuda.empty_cache()
