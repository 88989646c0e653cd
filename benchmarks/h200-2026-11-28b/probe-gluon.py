"""The Gluon attention spike (gluon_attn.py) on the device: correctness against cuDNN, and forward
TFLOP/s against cuDNN and the Triton forward with Hopper tiles (CUDA events, median of 20)."""
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
import torch
import kpt_triton.attention as A
from kpt_triton.attention import Tiles
import spike_gluon_attention as G

aten = torch.ops.aten


def etime(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


VARIANTS = [dict(overlap=False, stages=2), dict(overlap=False, stages=3), dict(overlap=True, stages=3),
            dict(overlap=True, stages=2), dict(overlap=False, stages=3, block_n=64), dict(overlap=True, stages=4, block_n=64)]
for b, hq, hkv, s, d, causal in [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True),
                                 (2, 32, 8, 8192, 128, True), (8, 32, 32, 1024, 64, False), (8, 32, 32, 1024, 64, True)]:
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    o_ref, lse_ref = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    lse_ref = lse_ref.reshape(b, hq, s)
    t_cudnn = etime(lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale))
    tiles = {d: Tiles(128, 128 if d == 128 else 64, 8, 3)}
    t_tri = etime(lambda: A.attention_fwd(q, k, v, causal, scale, tiles=tiles))
    line = [f"B{b} H{hq}/{hkv} S{s} D{d} {'causal' if causal else 'full'}: cuDNN {flops / t_cudnn / 1e9:.0f}, "
            f"triton {flops / t_tri / 1e9:.0f}"]
    for var in VARIANTS:
        name = f"ov{int(var['overlap'])} st{var['stages']} bn{var.get('block_n', 128)}"
        try:
            o, lse = G.attention(q, k, v, causal, scale, **var)
            torch.cuda.synchronize()
            err = float((o.float() - o_ref.float()).abs().max())
            lerr = float((lse - lse_ref).abs().max())
            t = etime(lambda: G.attention(q, k, v, causal, scale, **var))
            line.append(f"{name} {flops / t / 1e9:.0f} ({t_cudnn / t:.2f}x cuDNN, |do| {err:.3f} |dlse| {lerr:.4f})")
        except Exception as e:
            line.append(f"{name} FAILED {type(e).__name__}: {str(e)[:200]}")
    print(" | ".join(line), flush=True)
    del q, k, v
    torch.cuda.empty_cache()
