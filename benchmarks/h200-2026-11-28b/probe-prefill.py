"""Chunked prefill (fewer queries than keys, causal bottom-right) on the H200: kpt-cuda's library
choice (FlashAttention-2 or cuDNN with kpt's mask) against the portable Triton forward with Hopper
tiles; forward TFLOP/s over the visible pairs, CUDA events, median of 15."""
import torch
import kpt_triton.attention as A
import kpt_cuda.attention as C
from kpt_triton.attention import Tiles

SHAPES = [(1, 32, 8, 512, 8192, 128), (2, 32, 8, 512, 4096, 128), (1, 32, 8, 1024, 16384, 128),
          (1, 32, 8, 2048, 65536, 128), (4, 32, 8, 4096, 32768, 128), (1, 32, 8, 4096, 8192, 128),
          (2, 32, 8, 2048, 4096, 128), (1, 32, 32, 256, 4096, 128), (4, 32, 8, 1024, 16384, 64),
          (1, 16, 16, 1024, 8192, 256)]
TILES = [Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3), Tiles(64, 64, 8, 2)]


def etime(fn, reps=15):
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


for b, hq, hkv, sq, skv, d in SHAPES:
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    pairs = sq * skv - sq * (sq - 1) / 2
    flops = 4 * b * hq * pairs * d
    lib = C._library(q, k, True, scale)
    o_ref, _ = C.attention_fwd(q, k, v, True, scale)
    t_lib = etime(lambda: C.attention_fwd(q, k, v, True, scale))
    line = [f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} D{d}: kpt-cuda ({lib}) {flops / t_lib / 1e9:.0f} ({t_lib:.3f} ms)"]
    for t in TILES if d <= 128 else [Tiles(128, 64, 8, 2), Tiles(64, 64, 8, 2), Tiles(32, 64, 8, 2)]:
        try:
            o, _ = A.attention_fwd(q, k, v, True, scale, tiles={max(64, d): t})
            err = float((o.float() - o_ref.float()).abs().max())
            ms = etime(lambda: A.attention_fwd(q, k, v, True, scale, tiles={max(64, d): t}))
            line.append(f"triton ({t.block_m},{t.block_n},{t.num_warps},{t.num_stages}) {flops / ms / 1e9:.0f} = "
                        f"{t_lib / ms:.2f}x" + (f" ERR {err:.3f}" if err > 0.05 else ""))
        except Exception as e:
            line.append(f"({t.block_m},{t.block_n}) fail {type(e).__name__}")
    print(" | ".join(line), flush=True)
    del q, k, v
    torch.cuda.empty_cache()
