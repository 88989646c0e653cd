"""The native cross-entropy at odd widths and strides, for compute-sanitizer."""
import torch
from kpt_cuda import cross_entropy as native
native.ONCHIP_MIN_V = 1
native.ONCHIP_MIN_ROWS_PER_SM = 0
for n, v, pad, dtype, eps in [(300, 50257, 8, torch.bfloat16, 0.0), (133, 32001, 0, torch.float16, 0.1),
                              (9, 65537, 4, torch.float32, 0.0), (5, 3, 0, torch.bfloat16, 0.0),
                              (140, 128255, 0, torch.bfloat16, 0.1), (200, 1031, 8, torch.bfloat16, 0.0)]:
    z = torch.randn(n, v + pad, device="cuda").to(dtype)[:, :v]
    t = torch.randint(0, v, (n,), device="cuda")
    t[0] = v - 1
    assert native.onchip_split(z, torch.cuda.get_device_properties().shared_memory_per_block_optin), (n, v)
    loss, dz = native.cross_entropy_fwd(z, t, -100, eps, "mean", True)
    torch.cuda.synchronize()
    print(n, v, dtype, float(loss), bool(dz.isfinite().all()))
