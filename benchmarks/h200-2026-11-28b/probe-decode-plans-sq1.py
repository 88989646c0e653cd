"""Decode plans that keep more programs (or more stages) in flight, on single long sequences at one
and eight queries; kpt-cuda's library (cuDNN at one query) beside; graph replay, GPU us."""
import math
import torch
import kpt_triton.attention as A
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

torch.manual_seed(0)
H200 = SM90_HBM3E["attention_fwd"]["decode"]
D = A.Decode
PLANS = {
    "h200": H200,
    "h200 w8": H200._replace(num_warps=8),
    "bn64 s4 pps1": D(block_n=64, num_stages=4, programs_per_sm=1, split_keys=512, wide_warps=8),
    "bn64 s3 pps2": D(block_n=64, num_stages=3, programs_per_sm=2, split_keys=512, wide_warps=8),
    "bn64 s3 pps2 w8": D(block_n=64, num_warps=8, num_stages=3, programs_per_sm=2, split_keys=512),
    "bn32 s6 pps2": D(block_n=32, num_stages=6, programs_per_sm=2, split_keys=512, wide_warps=8),
    "bn64 s2 pps3": D(block_n=64, num_stages=2, programs_per_sm=3, split_keys=256, wide_warps=8),
    "bn32 s3 pps4": D(block_n=32, num_stages=3, programs_per_sm=4, split_keys=256, wide_warps=8),
    "bn128 s2 pps1": D(block_n=128, num_stages=2, programs_per_sm=1, split_keys=512, wide_warps=8),
}
SHAPES = [(1, 32, 4, 1, 32768, 128, torch.bfloat16), (1, 32, 8, 1, 32768, 128, torch.bfloat16),
          (2, 32, 8, 1, 16384, 128, torch.bfloat16), (1, 32, 8, 1, 8192, 128, torch.bfloat16),
          (4, 32, 8, 1, 4096, 128, torch.bfloat16), (8, 32, 8, 1, 8192, 128, torch.bfloat16),
          (64, 32, 8, 1, 2048, 128, torch.bfloat16), (1, 32, 32, 1, 32768, 128, torch.bfloat16),
          (4, 32, 8, 1, 16384, 64, torch.float16), (1, 64, 8, 1, 65536, 128, torch.bfloat16),
          (1, 32, 4, 8, 32768, 128, torch.bfloat16), (1, 32, 8, 8, 32768, 128, torch.bfloat16),
          (8, 32, 8, 8, 8192, 128, torch.bfloat16), (8, 32, 4, 16, 8192, 128, torch.bfloat16)]


def gtime(fn, calls=10, reps=15):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    ts.sort()
    return ts[len(ts) // 2]


logs = {p: [] for p in PLANS}
logs_sq1 = {p: [] for p in PLANS}
for b, hq, hkv, sq, skv, d, dt in SHAPES:
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
    scale = d ** -0.5
    o_ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=False, enable_gqa=True) if sq == 1 else None
    nbytes = 2 * k.numel() * k.element_size()
    lib = C._library(q, k, True, scale, decode=H200)
    t_lib = gtime(lambda: C.attention_fwd(q, k, v, True, scale, decode=H200))
    line = [f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} D{d}: kpt-cuda ({lib or 'decode'}) {t_lib:.1f}"]
    times = {}
    for name, plan in PLANS.items():
        try:
            o, _ = A.attention_fwd(q, k, v, True, scale, decode=plan)
            if o_ref is not None:
                err = float((o.float() - o_ref).abs().max())
                assert err < 2e-2, err
            times[name] = t = gtime(lambda: A.attention_fwd(q, k, v, True, scale, decode=plan))
            line.append(f"{name} {t:.1f}")
        except Exception as e:
            line.append(f"{name} ERR {repr(e)[:80]}")
    best = min(times.values())
    for name, t in times.items():
        logs[name].append(math.log(t / best))
        if sq == 1:
            logs_sq1[name].append(math.log(t / best))
    print(" | ".join(line), f"| best {best:.1f} = {nbytes / best / 1e6:.2f} TB/s, lib/best {t_lib / best:.3f}",
          flush=True)
    del q, k, v
    torch.cuda.empty_cache()
for title, lg in (("all", logs), ("one query", logs_sq1)):
    print("--", title)
    for name, l in sorted(lg.items(), key=lambda kv: sum(kv[1]) / max(1, len(kv[1]))):
        if l:
            print(f"{name:18s} geomean/best {math.exp(sum(l) / len(l)):.3f} worst {math.exp(max(l)):.3f} over {len(l)}")
