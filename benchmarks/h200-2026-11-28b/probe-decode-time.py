"""Where a decode call's time goes on a single long sequence: the H200 plan's full call, its main
kernel alone, its combine kernel alone, an empty Triton kernel, a copy of the same bytes, cuDNN;
graph replay, GPU us per call."""
import torch, triton, triton.language as tl
import kpt_triton.attention as A
from kpt_triton.tiling import cdiv, next_pow2
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

PLAN = SM90_HBM3E["attention_fwd"]["decode"]
torch.manual_seed(0)
SHAPES = [(1, 32, 4, 1, 32768), (1, 32, 4, 8, 32768), (1, 32, 8, 1, 32768), (1, 32, 8, 8, 32768),
          (8, 32, 8, 1, 8192), (8, 32, 8, 8, 8192), (2, 32, 8, 1, 16384), (1, 32, 8, 1, 131072)]


@triton.jit
def _empty(X):
    pass


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
    ts.sort()
    return ts[len(ts) // 2]


def parts(q, k, v, scale, plan):
    """The launches of A._decode, split."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    rows = Hq // Hkv * Sq
    block_m, block_d = max(16, next_pow2(rows)), max(16, next_pow2(D))
    block_n = plan.block_n
    while block_n > 16 and block_m * block_n > plan.scores:
        block_n //= 2
    wave = torch.cuda.get_device_properties(0).multi_processor_count * plan.programs_per_sm // (B * Hkv)
    splits = max(1, min(wave, cdiv(Skv, plan.split_keys), A.MAX_SPLITS))
    chunk = cdiv(cdiv(Skv, splits), block_n) * block_n
    splits = cdiv(Skv, chunk)
    o = torch.empty_like(q); lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    out = torch.empty((B * Hkv, splits, block_m, block_d), dtype=torch.float32, device=q.device)
    out_lse = torch.empty((B * Hkv, splits, block_m), dtype=torch.float32, device=q.device)
    warps = (plan.wide_warps or plan.num_warps) if block_m > 64 else plan.num_warps

    def main():
        A._attn_decode_kernel[(splits, B * Hkv)](
            q, k, v, out, out_lse, *q.stride(), *k.stride(), *v.stride(),
            Hkv, Hq // Hkv, Sq, Skv, chunk, scale * A._LOG2E,
            CAUSAL=True, DIRECT=splits == 1, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            DOT_FP32=A.DOT_FP32, PRECISION="ieee", num_warps=warps, num_stages=plan.num_stages)

    def combine():
        A._attn_decode_combine_kernel[(B * Hkv * rows,)](
            out, out_lse, o, lse, splits, ROWS=rows, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d,
            BLOCK_S=next_pow2(splits))
    return main, combine, splits, block_n


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "plan", PLAN)
x = torch.empty(16, device="cuda")
print(f"empty Triton kernel in a graph: {gtime(lambda: _empty[(1,)](x)):.2f} us; two: "
      f"{gtime(lambda: (_empty[(1,)](x), _empty[(1,)](x))):.2f}")
for b, hq, hkv, sq, skv in SHAPES:
    d, dt = 128, torch.bfloat16
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
    scale = d ** -0.5
    nbytes = 2 * k.numel() * 2
    main, combine, splits, bn = parts(q, k, v, scale, PLAN)
    t_full = gtime(lambda: A.attention_fwd(q, k, v, True, scale, decode=PLAN))
    t_main, t_comb = gtime(main), gtime(combine)
    kv = torch.cat([k.view(-1), v.view(-1)]); dst = torch.empty_like(kv)
    t_copy = gtime(lambda: dst.copy_(kv))
    t_lib = gtime(lambda: C.attention_fwd(q, k, v, True, scale)) if sq == 1 else float("nan")
    print(f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} [{splits} chunks, bn{bn}]: full {t_full:.1f} | main {t_main:.1f} "
          f"({nbytes / t_main / 1e6:.2f} TB/s) | combine {t_comb:.1f} | copy of K+V (2x bytes) {t_copy:.1f} "
          f"({2 * nbytes / t_copy / 1e6:.2f} TB/s) | cuDNN {t_lib:.1f} | full at {nbytes / t_full / 1e6:.2f} TB/s",
          flush=True)
    del q, k, v, kv, dst
    torch.cuda.empty_cache()
