"""compute-sanitizer memcheck over kpt-cuda's persistent warp-specialized forward: more tiles than
programs (the tile counter), odd lengths, strided views, grouped-query, causal and not, against a
float64 reference."""
import torch

import kpt
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

torch.manual_seed(0)
ref = kpt.get_backend("reference")
plan = SM90_HBM3E["attention_fwd"]["warp_specialized"]
n = 0
for dt in (torch.bfloat16, torch.float16):
    for b, hq, hkv, sq, skv, causal in [(2, 4, 2, 300, 1000, True), (1, 8, 8, 129, 129, True), (1, 4, 1, 77, 333, False),
                                        (1, 4, 4, 1, 700, True), (1, 2, 2, 1, 1, False), (4, 16, 4, 1000, 1000, True),
                                        (8, 16, 16, 700, 700, False), (2, 24, 8, 1300, 1301, True)]:
        q = torch.randn(b, sq, hq, 128, device="cuda", dtype=dt).transpose(1, 2)
        k = torch.randn(b, hkv, skv, 128, device="cuda", dtype=dt)
        v = torch.randn(b, skv, hkv, 128, device="cuda", dtype=dt).transpose(1, 2)
        o, lse = C.warp_specialized_fwd(C._fused_layout(q), k, C._fused_layout(v), causal, 128 ** -0.5, plan)
        want = ref.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), causal=causal)
        err = float((o.double().cpu() - want).abs().nan_to_num(1e9).max())
        assert err < 3e-2, (dt, b, hq, hkv, sq, skv, causal, err)
        n += 1
torch.cuda.synchronize()
print("warp-specialized forward calls checked:", n)
