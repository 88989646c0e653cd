"""How far the portable Triton forward (kpt_triton.attention._attn_fwd_kernel) gets on Hopper with
Hopper-sized tiles, against cuDNN and FlashAttention-2 through ATen: forward TFLOP/s (causal counts
the visible pairs), CUDA-event time, median of 20 calls after warm-up."""
import torch
import kpt_triton.attention as A
from kpt_triton.attention import Tiles

aten = torch.ops.aten
SHAPES = [(4, 32, 32, 4096, 128, True), (4, 32, 32, 4096, 128, False), (2, 32, 8, 8192, 128, True),
          (8, 32, 32, 1024, 64, False), (8, 32, 32, 1024, 64, True), (4, 16, 16, 2048, 256, True)]
TILES = {
    128: [Tiles(64, 64, 8, 2), Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 4), Tiles(128, 128, 8, 2),
          Tiles(128, 128, 8, 3), Tiles(64, 128, 4, 3), Tiles(128, 64, 4, 3), Tiles(256, 64, 8, 2),
          Tiles(128, 32, 8, 4)],
    64: [Tiles(64, 64, 8, 2), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 3),
         Tiles(64, 128, 4, 3), Tiles(128, 128, 8, 4)],
    256: [Tiles(32, 64, 8, 2), Tiles(64, 64, 8, 2), Tiles(128, 64, 8, 2), Tiles(64, 32, 4, 3), Tiles(128, 32, 8, 3)],
}


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


print(torch.cuda.get_device_name(), torch.__version__)
for b, hq, hkv, s, d, causal in SHAPES:
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    o_ref = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[0]
    t_cudnn = etime(lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale))
    if hq == hkv:
        t_flash = etime(lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale))
    else:
        kk, vv = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
        t_flash = etime(lambda: aten._scaled_dot_product_flash_attention(q, kk, vv, 0.0, causal, False, scale=scale))
    line = [f"B{b} H{hq}/{hkv} S{s} D{d} {'causal' if causal else 'full'}: cuDNN {flops / t_cudnn / 1e9:.0f}"
            f" flash {flops / t_flash / 1e9:.0f}"]
    best = (0, None)
    for t in TILES[d]:
        try:
            o, _ = A.attention_fwd(q, k, v, causal, scale, tiles={d: t})
            err = float((o.float() - o_ref.float()).abs().max())
            ms = etime(lambda: A.attention_fwd(q, k, v, causal, scale, tiles={d: t}))
            rate = flops / ms / 1e9
            line.append(f"({t.block_m},{t.block_n},{t.num_warps},{t.num_stages}) {rate:.0f}" + (f" ERR {err:.3f}" if err > 0.05 else ""))
            if err <= 0.05 and rate > best[0]:
                best = (rate, t)
        except Exception as e:
            line.append(f"({t.block_m},{t.block_n},{t.num_warps},{t.num_stages}) fail {type(e).__name__}")
    print(" | ".join(line), f"|| best {best[0]:.0f} = {best[0] * t_cudnn / flops * 1e9:.2f} of cuDNN", flush=True)
    del q, k, v
    torch.cuda.empty_cache()
