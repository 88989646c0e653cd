"""Forward + backward through kpt-cuda's chunked-prefill route (portable forward with the H200's
Hopper tiles, FlashAttention-2's backward) against a float32 reference, at route-sized shapes."""
import torch
import kpt
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

torch.manual_seed(0)
be = kpt.get_backend("cuda")
TILES = SM90_HBM3E["attention_fwd"]["tiles"]
print("backend", be, flush=True)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


for dt in (torch.bfloat16, torch.float16):
    for b, hq, hkv, sq, skv, d in [(1, 32, 8, 2048, 4096, 128), (1, 32, 8, 2048, 8192, 64), (2, 16, 4, 1600, 4000, 128)]:
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
        k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
        do = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
        lib = C._library(q, k, True, d ** -0.5, tiles=TILES)
        q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
        o = be.attention(q1, k1, v1, causal=True)
        o.backward(do)
        q2, k2, v2 = (t.float().requires_grad_() for t in (q, k, v))
        g = hq // hkv
        mask = torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril(skv - sq)
        o2 = torch.nn.functional.scaled_dot_product_attention(
            q2, k2.repeat_interleave(g, 1), v2.repeat_interleave(g, 1), attn_mask=mask)
        o2.backward(do.float())
        errs = [rel(o, o2), rel(q1.grad, q2.grad), rel(k1.grad, k2.grad), rel(v1.grad, v2.grad)]
        finite = all(bool(t.isfinite().all()) for t in (o, q1.grad, k1.grad, v1.grad))
        ok = finite and max(errs) < (2e-2 if dt == torch.bfloat16 else 5e-3)
        print(f"{dt} B{b} H{hq}/{hkv} Sq{sq} Skv{skv} D{d}: route={lib} rel err o/dq/dk/dv "
              + " ".join(f"{e:.2e}" for e in errs) + (" OK" if ok else " FAIL"), flush=True)
        del q1, k1, v1, q2, k2, v2, o, o2
        torch.cuda.empty_cache()
