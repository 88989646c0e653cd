"""The decode kernel's chunking and plans on an H200, graph replay, GPU µs; one mode per call:

    python probe-decode-rules.py waves    # call 3: chunk counts (ceil / floor of a wave) x stages
    python probe-decode-rules.py plans3   # call 4: plans (kpt_triton.attention.Decode), one-wave rule
    python probe-decode-rules.py plans4   # call 6: warps and score caps of kpt-cuda's plan

The three ran as separate copies of this script, merged afterwards. In call 4 a plan's key block
and stages alone fell back to the portable ones at head dim 256 (its other fields applied); the
code since gives such calls the whole portable plan. ``wide_warps`` came after call 6: its "w8"
plans set ``num_warps``."""
import math, sys
import torch
import kpt_triton.attention as A
from kpt_triton.tiling import cdiv, next_pow2
import kpt_cuda.attention as C

MODE = sys.argv[1]
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


def splits_floor(bh, skv, per_sm, keys):  # at most one wave of per_sm programs per multiprocessor
    return max(1, min((SM * per_sm) // bh, cdiv(skv, keys), A.MAX_SPLITS))


POLICIES = {  # name: (rule, programs per SM, keys per chunk, block_n, stages)
    "ceil2 s2 (committed)": (splits_ceil, 2, 256, 64, 2),
    "ceil2 s3": (splits_ceil, 2, 256, 64, 3),
    "floor2 s2": (splits_floor, 2, 256, 64, 2),
    "floor2 s3": (splits_floor, 2, 256, 64, 3),
    "floor3 s2": (splits_floor, 3, 256, 64, 2),
    "floor2 s3 k512": (splits_floor, 2, 512, 64, 3),
    "floor1 s4": (splits_floor, 1, 256, 64, 4),
    "floor2 s4": (splits_floor, 2, 256, 64, 4),
    "floor1 bn128 s3": (splits_floor, 1, 512, 128, 3),
}


PLANS = {
    "plans3": {
        "portable Decode()": A.Decode(),
        "bn128 s3 pps1 k512": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=512),
        "bn128 s3 pps1 k512 uncapped": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=512,
                                                scores=16384),
        "bn128 s3 pps1 k256": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=256),
        "bn128 s2 pps1 k512": A.Decode(block_n=128, num_stages=2, programs_per_sm=1, split_keys=512),
        "bn64 s4 pps1 k512": A.Decode(block_n=64, num_stages=4, programs_per_sm=1, split_keys=512),
        "bn64 s3 pps1 k512": A.Decode(block_n=64, num_stages=3, programs_per_sm=1, split_keys=512),
        "bn64 s3 pps2 k256": A.Decode(block_n=64, num_stages=3, programs_per_sm=2, split_keys=256),
    },
    "plans4": {
        "w4 bn128 s3 pps1 k512": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=512),
        "w8 bn128 s3 pps1 k512": A.Decode(block_n=128, num_warps=8, num_stages=3, programs_per_sm=1, split_keys=512),
        "w4 bn128 s3 pps1 k512 scores4096": A.Decode(block_n=128, num_stages=3, programs_per_sm=1, split_keys=512,
                                                     scores=4096),
        "w8 bn128 s3 pps2 k512": A.Decode(block_n=128, num_warps=8, num_stages=3, programs_per_sm=2, split_keys=512),
        "w8 bn64 s4 pps1 k512": A.Decode(block_n=64, num_warps=8, num_stages=4, programs_per_sm=1, split_keys=512),
    },
}.get(MODE, {})


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
COMMITTED = 'committed (ceil2 bn64 s2 k256)'
logs = {p: [] for p in (POLICIES if MODE == 'waves' else [COMMITTED, *PLANS])}
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
    for name, (rule, per_sm, keys, bn, st) in (POLICIES.items() if MODE == "waves" else ()):
        if d == 256 and (bn * st > 128):
            line.append(f"{name} -"); continue
        n = rule(b * hkv, skv, per_sm, keys)
        try:
            o, _ = run(q, k, v, True, scale, n, bn, st)
            err = float((o.float() - o_ref).abs().max())
            assert err < 2e-2, err
            t = gtime(lambda: run(q, k, v, True, scale, n, bn, st))
        except Exception as e:
            line.append(f"{name} ERR {repr(e)[:60]}"); continue
        times[name] = t
        line.append(f"{name} [{n}x{b*hkv}] {t:.1f}")
    if MODE != "waves":
        n = splits_ceil(b * hkv, skv, 2, 256)
        o, _ = run(q, k, v, True, scale, n, 64, 2)
        assert float((o.float() - o_ref).abs().max()) < 2e-2
        times[COMMITTED] = t = gtime(lambda: run(q, k, v, True, scale, n, 64, 2))
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
