"""compute-sanitizer memcheck over the decode kernel: odd lengths, padded head dims, strided views,
one chunk (direct) and many, Sq > Skv, through kpt-triton and the cuda backend."""
import torch
import kpt
import kpt_triton.attention as A
from kpt_cuda.tuning import SM90, SM90_HBM3E

torch.manual_seed(0)
be = kpt.get_backend("cuda")
ref = kpt.get_backend("reference")
plans = [SM90_HBM3E["attention_fwd"]["decode"]]
n = 0
for dt in (torch.bfloat16, torch.float16, torch.float32):
    for b, hq, hkv, sq, skv, d, causal in [(3, 6, 2, 5, 1000, 72, True), (2, 8, 8, 1, 777, 128, True),
                                           (1, 16, 2, 7, 4099, 64, False), (2, 4, 1, 9, 5, 40, True),
                                           (1, 8, 4, 3, 300, 256, True), (1, 32, 4, 16, 300, 128, True),
                                           (2, 16, 2, 13, 500, 64, False), (1, 32, 8, 4, 20001, 128, True),
                                           (1, 32, 4, 16, 3001, 128, True)]:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt).transpose(1, 2)  # strided
        k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, skv + 3, d, device="cuda", dtype=dt)[:, :, 3:]
        want = ref.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), causal=causal)
        for p in plans:
            o, lse = A.attention_fwd(q, k, v, causal, d ** -0.5, decode=p)
            err = float((o.double().cpu() - want).abs().nan_to_num(1e9).max())
            assert err < 3e-2, (dt, b, hq, hkv, sq, skv, d, causal, p, err)
            n += 1
        o = be.attention(q, k, v, causal=causal)
        assert float((o.double().cpu() - want).abs().nan_to_num(1e9).max()) < 3e-2
        n += 1
torch.cuda.synchronize()
print("decode calls checked:", n)
