"""compute-sanitizer memcheck over the portable forward with the H200's tiles: odd lengths, head dims
not a multiple of 8, strided views, chunked prefill (Sq < Skv, bottom-right causal), through
kpt-triton and kpt-cuda's routing; checked against the float64 reference."""
import torch
import kpt
import kpt_triton.attention as A
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

torch.manual_seed(0)
ref = kpt.get_backend("reference")
TILES = SM90_HBM3E["attention_fwd"]["tiles"]
n = 0
for dt in (torch.bfloat16, torch.float16):
    for b, hq, hkv, sq, skv, d, causal in [(2, 4, 2, 300, 1000, 72, True), (1, 8, 8, 129, 129, 128, True),
                                           (1, 4, 1, 77, 333, 64, False), (2, 6, 3, 200, 201, 40, True),
                                           (1, 2, 2, 513, 2049, 128, True), (1, 4, 4, 100, 90, 96, True)]:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt).transpose(1, 2)
        k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dt)
        v = torch.randn(b, hkv, skv + 5, d, device="cuda", dtype=dt)[:, :, 5:]
        want = ref.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), causal=causal)
        for fn in (lambda: A.attention_fwd(q, k, v, causal, d ** -0.5, tiles=TILES),
                   lambda: C.attention_fwd(q, k, v, causal, d ** -0.5, tiles=TILES)):
            o, _ = fn()
            err = float((o.double().cpu() - want).abs().nan_to_num(1e9).max())
            assert err < 3e-2, (dt, b, hq, hkv, sq, skv, d, causal, err)
            n += 1
torch.cuda.synchronize()
print("forward calls checked:", n)
