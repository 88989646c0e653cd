"""Decode kernel plans (kpt_triton.attention.Decode) on the one-wave rule, against the committed
rule (ceil: a partial second wave) and kpt-cuda's library at one query; graph replay."""
import math, sys
import torch
import kpt_triton.attention as A
from kpt_triton.tiling import cdiv, next_pow2
import kpt_cuda.attention as C

torch.manual_seed(0)
dev = "cuda"
aten = torch.ops.aten
SM = torch.cuda.get_device_properties(0).multi_processor_count
SHAPES = [  # b, hq, hkv, sq, skv, d, dtype
    (8, 32, 8, 1, 1024, 128, torch.bfloat16),
    (8, 32, 8, 1, 8192, 128, torch.bfloat16),
    (1, 32, 8, 1, 32768, 128, torch.bfloat16),
    (8, 32, 8, 8, 1024, 128, torch.bfloat16),
    (8, 32, 8, 8, 8192, 128, torch.bfloat16),
    (1, 32, 8, 8, 32768, 128, torch.bfloat16),
    (1, 32, 4, 1, 32768, 128, torch.bfloat16),
    (1, 32, 4, 8, 32768, 128, torch.bfloat16),
    (4, 32, 8, 1, 16384, 64, torch.float16),
    (2, 16, 8, 4, 16384, 256, torch.bfloat16),
    (32, 32, 8, 1, 4096, 128, torch.bfloat16),
    (1, 32, 32, 1, 32768, 128, torch.bfloat16),
    (1, 32, 8, 16, 32768, 128, torch.bfloat16),
    (8, 32, 4, 16, 8192, 128, torch.bfloat16),
    (8, 32, 8, 32, 8192, 128, torch.bfloat16),
    (4, 32, 8, 4, 4096, 128, torch.bfloat16),
    (16, 32, 8, 2, 2048, 128, torch.bfloat16),
    (64, 32, 8, 1, 2048, 128, torch.bfloat16),
]


def splits_ceil(bh, skv, per_sm, keys):  # the committed rule
    return max(1, min(cdiv(SM * per_sm, bh), cdiv(skv, keys), A.MAX_SPLITS))


PLANS = {
    "portable Decode()": A.Decode(),
    "bn128 s3 pps1 k512": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=512),
    "bn128 s3 pps1 k512 uncapped": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=512, scores=16384),
    "bn128 s3 pps1 k256": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=256),
    "bn128 s2 pps1 k512": A.Decode(block_n=128, num_stages=2, programs_per_sm=1, split_keys=512),
    "bn64 s4 pps1 k512": A.Decode(block_n=64, num_stages=4, programs_per_sm=1, split_keys=512),
    "bn64 s3 pps1 k512": A.Decode(block_n=64, num_stages=3, programs_per_sm=1, split_keys=512),
    "bn64 s3 pps2 k256": A.Decode(block_n=64, num_stages=3, programs_per_sm=2, split_keys=256),
}


def run(q, k, v, causal, scale, splits, block_n, stages):
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    rows = Hq // Hkv * Sq
    block_m = max(16, next_pow2(rows))
    block_d = max(16, next_pow2(D))
    chunk = cdiv(cdiv(Skv, splits), block_n) * block_n
    splits = cdiv(Skv, chunk)
    direct = splits == 1
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if direct:
        out, out_lse = o, lse
    else:
        out = torch.empty((B * Hkv, splits, block_m, block_d), dtype=torch.float32, device=q.device)
        out_lse = torch.empty((B * Hkv, splits, block_m), dtype=torch.float32, device=q.device)
    A._attn_decode_kernel[(splits, B * Hkv)](
        q, k, v, out, out_lse, *q.stride(), *k.stride(), *v.stride(),
        Hkv, Hq // Hkv, Sq, Skv, chunk, scale * A._LOG2E,
        CAUSAL=causal, DIRECT=direct, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_FP32=A.DOT_FP32, PRECISION="ieee", num_warps=4, num_stages=stages)
    if not direct:
        A._attn_decode_combine_kernel[(B * Hkv * rows,)](
            out, out_lse, o, lse, splits, ROWS=rows, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d,
            BLOCK_S=next_pow2(splits))
    return o, lse


def gtime(fn, calls=10, reps=15):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
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


print(torch.cuda.get_device_name(), "SMs", SM)
logs = {p: [] for p in ['committed (ceil2 bn64 s2 k256)', *PLANS]}
for b, hq, hkv, sq, skv, d, dt in SHAPES:
    q = torch.randn(b, hq, sq, d, device=dev, dtype=dt)
    k = torch.randn(b, hkv, skv, d, device=dev, dtype=dt)
    v = torch.randn(b, hkv, skv, d, device=dev, dtype=dt)
    scale = d ** -0.5
    kk = k.float().repeat_interleave(hq // hkv, 1); vv = v.float().repeat_interleave(hq // hkv, 1)
    s = (q.float() @ kk.transpose(-1, -2)) * scale
    i = torch.arange(sq, device=dev)[:, None]; j = torch.arange(skv, device=dev)[None]
    s = s.masked_fill(j > i + skv - sq, float("-inf"))
    o_ref = torch.softmax(s, -1) @ vv
    del kk, vv, s
    nbytes = 2 * k.numel() * k.element_size()
    lib = C._library(q, k, True, scale)
    t_lib = gtime(lambda: C.attention_fwd(q, k, v, True, scale))
    line = [f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} D{d} {str(dt)[6:]}: kpt-cuda ({lib or 'decode'}) {t_lib:.1f}"]
    times = {}
    n = splits_ceil(b * hkv, skv, 2, 256)
    o, _ = run(q, k, v, True, scale, n, 64, 2)
    assert float((o.float() - o_ref).abs().max()) < 2e-2
    times["committed (ceil2 bn64 s2 k256)"] = t = gtime(lambda: run(q, k, v, True, scale, n, 64, 2))
    line.append(f"committed [{n}] {t:.1f}")
    for name, plan in PLANS.items():
        try:
            o, _ = A.attention_fwd(q, k, v, True, scale, decode=plan)
            err = float((o.float() - o_ref).abs().max())
            assert err < 2e-2, err
            t = gtime(lambda: A.attention_fwd(q, k, v, True, scale, decode=plan))
        except Exception as e:
            line.append(f"{name} ERR {repr(e)[:60]}"); continue
        times[name] = t
        line.append(f"{name} {t:.1f}")
    best = min(times.values())
    for name, t in times.items():
        logs[name].append(math.log(t / best))
    print(" | ".join(line), f"| best {best:.1f} = {nbytes / best / 1e6:.2f} TB/s", flush=True)
    del q, k, v
    torch.cuda.empty_cache()
for name, l in sorted(logs.items(), key=lambda kv: sum(kv[1]) / max(1, len(kv[1]))):
    if l:
        print(f"{name:24s} geomean/best {math.exp(sum(l) / len(l)):.3f} worst {math.exp(max(l)):.3f} over {len(l)}")
