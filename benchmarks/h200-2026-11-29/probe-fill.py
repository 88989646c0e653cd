"""The warp-specialized forward against FlashAttention-2 when its tiles fill part of the GPU
(GPU time, 10 back-to-back calls a sample, 5 interleaved rounds)."""
import statistics
import torch
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

T = SM90_HBM3E["attention_fwd"]
aten = torch.ops.aten


def gpu_time(fn, n=10):
    a, e = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n):
        fn()
    e.record(); e.synchronize()
    return a.elapsed_time(e) / n


for b, hq, hkv, sq, skv in [(1, 32, 8, 64, 8192), (1, 32, 8, 128, 16384), (1, 32, 8, 256, 8192), (1, 32, 8, 256, 32768),
                            (1, 32, 8, 384, 8192), (1, 32, 8, 512, 8192), (1, 32, 8, 512, 32768), (1, 16, 4, 512, 16384),
                            (2, 32, 8, 512, 8192), (1, 32, 32, 256, 4096), (4, 32, 8, 128, 4096), (1, 32, 8, 1024, 2048), (4, 32, 8, 1024, 2048), (2, 32, 8, 1024, 4096)]:
    q = torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, skv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, skv, 128, device="cuda", dtype=torch.bfloat16)
    s = 128 ** -0.5
    fns = {"flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=s),
           "ws": lambda: C.warp_specialized_fwd(q, k, v, True, s, T["warp_specialized"]),
           "kpt": lambda: C.attention_fwd(q, k, v, True, s, **T)}
    o1 = fns["flash"]()[0]; o2 = fns["ws"]()[0]
    err = float((o1.float() - o2.float()).abs().max())
    torch.cuda.synchronize()
    times = {n: [] for n in fns}
    for _ in range(5):
        for n, fn in fns.items():
            times[n].append(gpu_time(fn))
    ratio = statistics.median(a / w for a, w in zip(times["flash"], times["ws"]))
    kratio = statistics.median(a / w for a, w in zip(times["flash"], times["kpt"]))
    route = C._library(q, k, True, s, tiles=T["tiles"], warp_specialized=T["warp_specialized"])
    tiles = b * hq * -(-sq // 128)
    print(f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} ({tiles} tiles, {tiles / 132:.2f} of the SMs): flash "
          f"{statistics.median(times['flash']) * 1e3:.1f} us, ws {statistics.median(times['ws']) * 1e3:.1f} us = "
          f"{ratio:.2f}x; kpt-cuda ({route}) {kratio:.2f}x  |do| {err:.3f}", flush=True)
