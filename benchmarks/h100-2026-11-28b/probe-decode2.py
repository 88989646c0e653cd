"""(1) one-query decode plans against cuDNN; (2) the decode kernel at 128 rows (Sq16 GQA8) against
FlashAttention-2; (3) where a decode call's host time goes (cProfile)."""
import cProfile, itertools, pstats, io, time
import torch
import kpt
import kpt_triton.attention as A
import kpt_cuda.attention as C
aten = torch.ops.aten


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
    return sorted(ts)[len(ts) // 2]


def qkv(b, hq, hkv, sq, skv, d=128):
    return (torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16),
            torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16),
            torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16))


print("## (1) one query")
plans = [A.Decode(bn, w, st, pps, sk) for bn, w, st, pps, sk in itertools.product(
    (32, 64), (2, 4), (3, 4, 6), (1, 2, 4), (256, 1024))]
for shape in ():
    q, k, v = qkv(*shape)
    t_c = gtime(lambda: C.attention_fwd(q, k, v, True, 0.088))
    res = []
    for p in plans:
        try:
            res.append((gtime(lambda: A.attention_fwd(q, k, v, True, 0.088, decode=p)), tuple(p[:5])))
        except Exception as e:
            pass
    res.sort()
    print(shape, "cudnn %.1f" % t_c, "best", ["%.1f %s" % r for r in res[:3]], flush=True)

print("## (2) 128 rows")
tiles = {128: A.Tiles(128, 64, 8, 2)}
for shape in ((1, 32, 4, 16, 32768), (8, 32, 4, 16, 8192), (8, 32, 8, 32, 8192)):
    q, k, v = qkv(*shape)
    t_f = gtime(lambda: C.attention_fwd(q, k, v, True, 0.088))
    lib = C._library(q, k, True, 0.088)
    o_ref, l_ref = C.attention_fwd(q, k, v, True, 0.088)
    for w, bn in ((4, 64), (8, 64), (8, 32)):
        p = A.Decode(block_n=bn, num_warps=w)
        assert A.decodes(q, k, tiles)
        o, l = A.attention_fwd(q, k, v, True, 0.088, tiles=tiles, decode=p)
        err = float((o.float() - o_ref.float()).abs().max())
        print(shape, lib, "%.1f" % t_f, "decode w%d bn%d %.1f err %.2g" % (
            w, bn, gtime(lambda: A.attention_fwd(q, k, v, True, 0.088, tiles=tiles, decode=p)), err), flush=True)

print("## (3) host time of a decode call, B8 H32/8 Sq8 Skv1024")
be = kpt.get_backend("cuda")
q, k, v = qkv(8, 32, 8, 8, 1024)
for _ in range(100):
    be.attention(q, k, v, causal=True)
torch.cuda.synchronize()
for name, fn in (("backend.attention", lambda: be.attention(q, k, v, causal=True)),
                 ("kpt_triton attention_fwd", lambda: A.attention_fwd(q, k, v, True, 0.088))):
    per = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(300):
            fn()
        per.append((time.perf_counter() - t) / 300 * 1e6)
        torch.cuda.synchronize()
    print(name, "host µs min %.1f median %.1f" % (min(per), sorted(per)[2]))
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    be.attention(q, k, v, causal=True)
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue())
