"""The FA3-style Gluon spike (spike_ws_overlap.py, g2 in the outputs) against cuDNN, with and without\nping-pong, 2 and 3 K/V stages (calls 1-3; their other variants were small edits of the spike)."""
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
import torch
import spike_ws_overlap as g2

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


V = [("g2 pp st2", lambda q, k, v, c, s: g2.attention(q, k, v, c, s, stages=2)),
     ("g2 nopp st2", lambda q, k, v, c, s: g2.attention(q, k, v, c, s, stages=2, pingpong=False)),
     ("g2 pp st3", lambda q, k, v, c, s: g2.attention(q, k, v, c, s, stages=3)),
     ("g2 nopp st3", lambda q, k, v, c, s: g2.attention(q, k, v, c, s, stages=3, pingpong=False))]
if len(sys.argv) > 1:
    V = [x for x in V if any(a in x[0] for a in sys.argv[1:])]
SHAPES = [(4, 32, 32, 4096, 128, False, torch.bfloat16), (4, 32, 32, 4096, 128, True, torch.bfloat16),
          (4, 32, 32, 4096, 128, False, torch.float16), (4, 32, 32, 4096, 128, True, torch.float16),
          (16, 32, 32, 1024, 128, False, torch.bfloat16), (16, 32, 32, 1024, 128, True, torch.bfloat16),
          (1, 32, 32, 16384, 128, False, torch.bfloat16), (1, 32, 32, 16384, 128, True, torch.bfloat16),
          (2, 32, 8, 8192, 128, True, torch.bfloat16), (2, 32, 4, 8192, 128, True, torch.bfloat16),
          (4, 32, 32, 4096, 64, True, torch.bfloat16)]
for b, hq, hkv, s, d, causal, dt in SHAPES:
    q = torch.randn(b, hq, s, d, device="cuda", dtype=dt)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dt)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=dt)
    scale = d ** -0.5
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    o_ref, lse_ref = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    lse_ref = lse_ref.reshape(b, hq, s)
    t_cudnn = etime(lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale))
    line = [f"B{b} H{hq}/{hkv} S{s} D{d} {'causal' if causal else 'full'} {str(dt)[6:]}: cuDNN {flops / t_cudnn / 1e9:.0f}"]
    for name, fn in V:
        try:
            r = fn(q, k, v, causal, scale)
            if r is None:
                continue
            o, lse = r
            torch.cuda.synchronize()
            err = float((o.float() - o_ref.float()).abs().max())
            lerr = float((lse - lse_ref).abs().max())
            t = etime(lambda: fn(q, k, v, causal, scale))
            bad = " BAD" if not (err < 0.02 and lerr < 1e-3) else ""
            line.append(f"{name} {flops / t / 1e9:.0f} ({t_cudnn / t:.2f}x, |do| {err:.3f} |dlse| {lerr:.4f}{bad})")
        except Exception as e:
            line.append(f"{name} FAILED {type(e).__name__}: {str(e)[:300]}")
    print(" | ".join(line), flush=True)
    del q, k, v
    torch.cuda.empty_cache()
