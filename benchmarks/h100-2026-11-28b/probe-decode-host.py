"""Host time per call of a decode step (back-to-back calls, CPU clock, GPU work small): kpt's decode
kernel through the cuda backend against SDPA's backends, B8 H32/8 Sq8 Skv1024 D128 bf16 causal."""
import time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import kpt

be = kpt.get_backend("cuda")
q = torch.randn(8, 32, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(8, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
mask = torch.ones(8, 1024, dtype=torch.bool, device="cuda").tril(1024 - 8)


def kpt_call():
    be.attention(q, k, v, causal=True)


def sdpa(backend):
    def call():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return call


for name, fn in (("kpt cuda (decode kernel)", kpt_call), ("SDPA cuDNN, bool mask", sdpa(SDPBackend.CUDNN_ATTENTION)),
                 ("SDPA efficient, bool mask", sdpa(SDPBackend.EFFICIENT_ATTENTION))):
    try:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        per = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(200):
                fn()
            per.append((time.perf_counter() - t) / 200 * 1e6)
            torch.cuda.synchronize()
        per.sort()
        print(f"{name}: host µs per call min {per[0]:.1f} median {per[3]:.1f} max {per[-1]:.1f}")
    except Exception as e:
        print(name, "failed:", repr(e)[:100])
