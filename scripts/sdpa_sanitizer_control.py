"""torch's own SDPA on cuDNN, forward and backward, at the shapes of kpt's attention cases: the
control for compute-sanitizer reports inside cuDNN's kernels (which kpt-cuda calls for bf16/fp16
attention on Hopper). Named calls as `every_kernel.py --each` names them:

    compute-sanitizer --tool initcheck --print-limit 0 --show-backtrace no \
      python3 scripts/sdpa_sanitizer_control.py | awk -f scripts/sanitizer_summary.awk
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (batch, query heads, key/value heads, sequence, head dim, causal)
    "gqa_causal": (2, 8, 2, 64, 128, True),
    "llm": (2, 4, 4, 128, 64, False),
    "llm_causal": (2, 4, 4, 128, 64, True),
}

for name, (b, hq, hkv, s, d, causal) in SHAPES.items():
    print(f"call: torch sdpa cudnn {name}", flush=True)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    print(f"{name}: ok", flush=True)
