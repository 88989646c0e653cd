"""Two decode shapes through the H200 plan, a few calls each, for ncu."""
import torch
import kpt_triton.attention as A
from kpt_cuda.tuning import SM90_HBM3E
PLAN = SM90_HBM3E["attention_fwd"]["decode"]
for b, hq, hkv, sq, skv in [(1, 32, 4, 1, 32768), (1, 32, 4, 8, 32768), (8, 32, 8, 8, 8192)]:
    q = torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, skv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for _ in range(3):
        A.attention_fwd(q, k, v, True, 128 ** -0.5, decode=PLAN)
torch.cuda.synchronize()
