"""Host time per call, back to back (CPU clock, GPU work small): attention at one and eight queries
through each layer, SDPA beside, rms_norm 1 x 4096; and a count of the decode kernels' uncached
launches. Run once per code version (PYTHONPATH picks it)."""
import sys, time, cProfile, pstats, io
import torch
import torch.nn.functional as F
import kpt
import kpt_cuda.attention as C
import kpt_triton.attention as A
from kpt_triton import launch
from kpt_cuda.tuning import SM90_HBM3E

print("kpt from", kpt.__file__)
be = kpt.get_backend("cuda")
PLAN = SM90_HBM3E["attention_fwd"]["decode"]


def host_us(fn, calls=300, rounds=9):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    per.sort()
    return per[0], per[len(per) // 2]


firsts = {}
orig_first = launch.cached_launch._first
def counting_first(self, grid, args, kwargs):
    firsts[self.fn.__name__] = firsts.get(self.fn.__name__, 0) + 1
    return orig_first(self, grid, args, kwargs)
launch.cached_launch._first = counting_first

x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16); w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
lo, med = host_us(lambda: be.rms_norm(x, w))
print(f"rms_norm 1x4096 backend: host us min {lo:.1f} median {med:.1f}")
lo, med = host_us(lambda: F.rms_norm(x, (4096,), w))
print(f"F.rms_norm 1x4096: host us min {lo:.1f} median {med:.1f}")
for sq in (1, 8):
    q = torch.randn(1, 32, sq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    calls = {
        "backend.attention": lambda: be.attention(q, k, v, causal=True),
        "kpt_cuda.attention_fwd": lambda: C.attention_fwd(q, k, v, True, 128 ** -0.5, decode=PLAN),
        "kpt_triton.attention_fwd": lambda: A.attention_fwd(q, k, v, True, 128 ** -0.5, decode=PLAN),
        "SDPA (is_causal=Sq>1)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=sq > 1, enable_gqa=True),
    }
    for name, fn in calls.items():
        firsts.clear()
        lo, med = host_us(fn)
        print(f"B1 H32/8 Sq{sq} Skv1024 {name}: host us min {lo:.1f} median {med:.1f}; uncached launches {dict(firsts)}",
              flush=True)
    if sq == 1:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(1000):
            A.attention_fwd(q, k, v, True, 128 ** -0.5, decode=PLAN)
        pr.disable(); torch.cuda.synchronize()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12); print(s.getvalue()[:3500])
