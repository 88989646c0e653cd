"""kpt-cuda's persistent warp-specialized forward through the backend: forward + backward against a
float32 SDPA with an explicit bottom-right mask, at shapes `_library` routes to it (equal lengths and
chunks; [B, S, H, D] views, grouped-query, lengths off the tile), and the route of the sweep's shapes."""
import torch

import kpt
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

torch.manual_seed(0)
be = kpt.get_backend("cuda")
T = SM90_HBM3E["attention_fwd"]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


bad = 0
for dt in (torch.bfloat16, torch.float16):
    for b, hq, hkv, sq, skv, causal, layout in [
        (2, 32, 32, 2048, 2048, True, "bhsd"), (4, 16, 4, 2100, 2100, True, "bshd"),
        (2, 32, 8, 4096, 4096, False, "bshd"), (1, 64, 64, 4100, 4100, False, "bhsd"),
        (1, 32, 8, 2048, 4096, True, "bhsd"), (1, 32, 8, 1111, 7777, True, "bshd"),
    ]:
        def mk(*s):
            if layout == "bshd":
                return torch.randn(s[0], s[2], s[1], s[3], device="cuda", dtype=dt).transpose(1, 2)
            return torch.randn(*s, device="cuda", dtype=dt)
        q, k, v = mk(b, hq, sq, 128), mk(b, hkv, skv, 128), mk(b, hkv, skv, 128)
        do = torch.randn(b, hq, sq, 128, device="cuda", dtype=dt)
        lib = C._library(q, k, causal, 128 ** -0.5, tiles=T["tiles"], warp_specialized=T["warp_specialized"])
        q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = be.attention(q1, k1, v1, causal=causal)
        o.backward(do)
        q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
        mask = torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril(skv - sq) if causal else None
        o2 = torch.nn.functional.scaled_dot_product_attention(q2, k2.repeat_interleave(hq // hkv, 1),
                                                              v2.repeat_interleave(hq // hkv, 1), attn_mask=mask)
        o2.backward(do.float())
        errs = [rel(o, o2), rel(q1.grad, q2.grad), rel(k1.grad, k2.grad), rel(v1.grad, v2.grad)]
        ok = lib == "warp-specialized" and all(bool(t.isfinite().all()) for t in (o, q1.grad, k1.grad, v1.grad)) \
            and max(errs) < (2e-2 if dt == torch.bfloat16 else 5e-3)
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {dt} B{b} H{hq}/{hkv} Sq{sq} Skv{skv} {'causal' if causal else 'full'} {layout}:"
              f" route={lib} rel err o/dq/dk/dv " + " ".join(f"{e:.2e}" for e in errs), flush=True)
        del q1, k1, v1, q2, k2, v2, o, o2
print("fwd+bwd through the backend:", "all ok" if not bad else f"{bad} BAD", flush=True)

print("routes of the attention sweep's shapes (forward):")
for b, hq, hkv, sq, skv, d, causal in [(4, 32, 32, 4096, 4096, 128, False), (4, 32, 32, 4096, 4096, 128, True),
                                       (16, 32, 32, 1024, 1024, 128, False), (16, 32, 32, 1024, 1024, 128, True),
                                       (1, 32, 32, 16384, 16384, 128, False), (1, 32, 32, 16384, 16384, 128, True),
                                       (2, 32, 8, 8192, 8192, 128, True), (2, 32, 4, 8192, 8192, 128, True),
                                       (4, 32, 32, 4096, 4096, 64, True), (4, 16, 8, 4096, 4096, 256, True),
                                       (1, 32, 8, 512, 8192, 128, True), (1, 32, 8, 4096, 16384, 128, True)]:
    q = torch.empty(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16)
    print(f"  B{b} H{hq}/{hkv} Sq{sq} Skv{skv} D{d} {'causal' if causal else 'full'}:",
          C._library(q, k, causal, d ** -0.5, tiles=T["tiles"], warp_specialized=T["warp_specialized"]))
