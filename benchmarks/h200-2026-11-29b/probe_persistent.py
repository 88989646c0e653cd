"""Equal-length and chunked attention forward: cuDNN, kpt-cuda's warp-specialized forward (one program
per tile, heads fastest) and the spike's tile orders, one program per tile and persistent. Rounds take
turns; GPU time of 5 back-to-back calls per sample, median of the rounds' samples."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import spike_persistent as S  # noqa: E402
from kpt_cuda import attention as A, tuning  # noqa: E402

aten = torch.ops.aten
SMS = torch.cuda.get_device_properties(0).multi_processor_count
PLAN = tuning.SM90_HBM3E["attention_fwd"]["warp_specialized"]


def cudnn(q, k, v, causal, scale):
    o, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return o, lse.reshape(q.shape[:3])


def flash(q, k, v, causal, scale):
    o, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return o, lse


VARIANTS = {
    "kpt-ws": lambda q, k, v, c, s, **kw: A.warp_specialized_fwd(q, k, v, c, s, PLAN),
    "pers/8M": lambda q, k, v, c, s, **kw: S.attention(q, k, v, c, s, programs=SMS, budget=8 << 20, **kw),
    **{f"dyn/{n}": (lambda budget: lambda q, k, v, c, s, **kw: S.attention(
        q, k, v, c, s, programs=SMS, budget=budget, dynamic=True, **kw))(budget)
       for n, budget in (("4M", 4 << 20), ("8M", 8 << 20), ("16M", 16 << 20), ("32M", 32 << 20), ("wave", "wave"))},
}
SHAPES = [  # b, hq, hkv, sq, skv, d, causal, dtype
    (4, 32, 32, 4096, 4096, 128, False, torch.bfloat16), (4, 32, 32, 4096, 4096, 128, True, torch.bfloat16),
    (4, 32, 32, 4096, 4096, 128, False, torch.float16), (4, 32, 32, 4096, 4096, 128, True, torch.float16),
    (16, 32, 32, 1024, 1024, 128, False, torch.bfloat16), (16, 32, 32, 1024, 1024, 128, True, torch.bfloat16),
    (1, 32, 32, 16384, 16384, 128, False, torch.bfloat16), (1, 32, 32, 16384, 16384, 128, True, torch.bfloat16),
    (2, 32, 8, 8192, 8192, 128, True, torch.bfloat16), (2, 32, 4, 8192, 8192, 128, True, torch.bfloat16),
    (16, 32, 8, 1024, 1024, 128, True, torch.bfloat16),
    (4, 32, 32, 4096, 4096, 64, True, torch.bfloat16), (4, 32, 32, 4096, 4096, 64, True, torch.float16),
    (1, 32, 32, 2048, 2048, 128, False, torch.bfloat16), (1, 32, 8, 1024, 1024, 128, True, torch.bfloat16),
    (2, 16, 16, 4096, 4096, 128, True, torch.bfloat16), (1, 16, 16, 1024, 1024, 128, False, torch.bfloat16),
    (1, 32, 8, 512, 8192, 128, True, torch.bfloat16), (1, 32, 8, 4096, 16384, 128, True, torch.bfloat16),
    (3, 16, 4, 1000, 3001, 128, True, torch.float16), (2, 8, 8, 777, 777, 128, False, torch.bfloat16),
    (1, 32, 32, 4096, 4096, 128, False, torch.bfloat16), (1, 32, 32, 4096, 4096, 128, True, torch.bfloat16),
    (2, 32, 32, 2048, 2048, 128, True, torch.bfloat16), (1, 32, 8, 8192, 8192, 128, True, torch.bfloat16),
    (4, 8, 8, 2048, 2048, 128, False, torch.bfloat16), (8, 32, 8, 2048, 2048, 128, True, torch.float16),
]
only = sys.argv[1:]


def gpu_ms(fn, calls=5):
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


for b, hq, hkv, sq, skv, d, causal, dt in SHAPES:
    gen = torch.Generator(device="cuda").manual_seed(sq * 7 + skv)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt, generator=gen)
               for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
    scale = d ** -0.5
    pairs = sq * skv - (sq * (sq - 1) // 2 if causal else 0) if causal else sq * skv
    flops = 4 * b * hq * pairs * d
    name = f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} D{d} {'causal' if causal else 'full'} {str(dt)[6:]}"
    peer = "cuDNN"
    if sq == skv:
        ref_fn = cudnn
        o_ref, lse_ref = cudnn(q, k, v, causal, scale)
    else:
        peer, ref_fn = "FA2", flash
        o_ref, lse_ref = flash(q, k, v, causal, scale)
    fns = {peer: ref_fn, **{n: f for n, f in VARIANTS.items() if not only or n in only}}
    errs = {}
    for n, f in fns.items():
        torch.cuda.synchronize()
        try:
            o, lse = f(q, k, v, causal, scale, **({} if n in (peer, 'kpt-ws') else {'poison': True}))
            torch.cuda.synchronize()
            errs[n] = ((o.float() - o_ref.float()).abs().max().item(), (lse - lse_ref).abs().max().item(),
                       bool(torch.isfinite(o).all()))
        except Exception as e:  # noqa: BLE001
            errs[n] = repr(e)[:200]
    times = {n: [] for n in fns if not isinstance(errs[n], str)}
    for n in times:
        gpu_ms(lambda: fns[n](q, k, v, causal, scale), 2)
    for _ in range(5):
        for n in times:
            times[n].append(gpu_ms(lambda: fns[n](q, k, v, causal, scale)))
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    line = [f"{name}: {peer} {flops / med[peer] / 1e9:.0f} TF/s"]
    for n in fns:
        if n == peer:
            continue
        e = errs[n]
        if isinstance(e, str):
            line.append(f"{n} ERROR {e}")
        else:
            ok = e[2] and e[0] < (0.05 if dt == torch.bfloat16 else 0.01) and e[1] < 1e-3
            line.append(f"{n} {flops / med[n] / 1e9:.0f} ({med[peer] / med[n]:.3f}x{'' if ok else f' WRONG {e}'})")
    print(" | ".join(line), flush=True)
