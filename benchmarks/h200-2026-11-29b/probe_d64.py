"""kpt-cuda's persistent warp-specialized forward at head dim 64 with 2, 3 and 4 K/V stages (128 keys a
step) against cuDNN: GPU time of 5 back-to-back calls a sample, median of 5 rounds taking turns;
outputs and lse poisoned with NaN before the checked call."""
import torch

import kpt_cuda.attention as A
from kpt_cuda.tuning import SM90_HBM3E

aten = torch.ops.aten
PLAN = SM90_HBM3E["attention_fwd"]["warp_specialized"]
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def cudnn(q, k, v, causal, scale):
    o, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return o, lse.reshape(q.shape[:3])


def ws(stages):
    def run(q, k, v, causal, scale, poison=False):
        b, hq, sq, d = q.shape
        o = torch.empty_like(q)
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        if poison:
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        counter = torch.zeros(1, dtype=torch.int32, device=q.device)
        n_tiles = b * hq * -(-sq // 128)
        desc = (A._descriptor(q, 64), A._descriptor(k, 128), A._descriptor(v, 128), A._descriptor(o, 64))
        A._attn_fwd_ws[(min(n_tiles, SMS), )](*desc, lse, counter, hq, hq // k.shape[1], sq, k.shape[2], n_tiles,
                                              A._section_heads(q, k, PLAN), scale * A.LOG2E, CAUSAL=causal,
                                              STAGES=stages, CONSUMER_REGS=240, PRODUCER_REGS=24, num_warps=4)
        return o, lse
    return run


def gpu_ms(fn, calls=5):
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


FNS = {"cuDNN": cudnn, "st2": ws(2), "st3": ws(3), "st4": ws(4)}
for b, hq, hkv, s, causal, dt in [(4, 32, 32, 4096, True, torch.bfloat16), (4, 32, 32, 4096, True, torch.float16),
                                  (4, 32, 32, 4096, False, torch.bfloat16), (8, 32, 8, 2048, True, torch.bfloat16),
                                  (2, 32, 32, 2048, True, torch.bfloat16), (1, 32, 32, 16384, True, torch.bfloat16),
                                  (16, 32, 32, 1024, False, torch.bfloat16), (3, 16, 4, 3001, True, torch.float16)]:
    d = 64
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    flops = 4 * b * hq * (s * s - (s * (s - 1) // 2 if causal else 0)) * d
    o_ref, lse_ref = cudnn(q, k, v, causal, scale)
    errs = {}
    for n, f in FNS.items():
        if n != "cuDNN":
            o, lse = f(q, k, v, causal, scale, poison=True)
            torch.cuda.synchronize()
            errs[n] = ((o.float() - o_ref.float()).abs().max().item(), (lse - lse_ref).abs().max().item())
    times = {n: [] for n in FNS}
    for n in FNS:
        gpu_ms(lambda: FNS[n](q, k, v, causal, scale), 2)
    for _ in range(5):
        for n in FNS:
            times[n].append(gpu_ms(lambda: FNS[n](q, k, v, causal, scale)))
    med = {n: sorted(t)[2] for n, t in times.items()}
    line = [f"B{b} H{hq}/{hkv} S{s} D{d} {'causal' if causal else 'full'} {str(dt)[6:]}: cuDNN {flops / med['cuDNN'] / 1e9:.0f} TF/s"]
    for n in FNS:
        if n != "cuDNN":
            e = errs[n]
            ok = e[0] < (0.05 if dt == torch.bfloat16 else 0.01) and e[1] < 1e-3
            line.append(f"{n} {flops / med[n] / 1e9:.0f} ({med['cuDNN'] / med[n]:.3f}x{'' if ok else f' WRONG {e}'})")
    print(" | ".join(line), flush=True)
