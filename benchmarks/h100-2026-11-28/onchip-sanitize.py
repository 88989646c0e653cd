"""The on-chip kernels (forward, cross-entropy, backward) at odd widths and strides, for compute-sanitizer."""
import torch
from kpt_cuda import cross_entropy as ce, onchip, softmax as sm
onchip.MIN_ROWS_PER_SM = 0
ce.ONCHIP_MIN_V = 1
sm.BACKWARD_MIN_WIDTH = 0
for n, v, pad, dt in [(300, 50257, 8, torch.bfloat16), (133, 32001, 0, torch.float16), (9, 40003, 4, torch.float32),
                      (140, 128255, 0, torch.bfloat16), (5, 20, 0, torch.bfloat16), (3, 151937, 0, torch.float16)]:
    x = torch.randn(n, v + pad, device="cuda").to(dt)[:, :v]
    (y,) = sm.softmax_fwd(x, 1, max_block=16)
    dy = torch.randn(n, v + pad, device="cuda").to(dt)[:, :v]
    (dx,) = sm.softmax_bwd(x, 1, y, dy, max_block=16)
    t = torch.randint(0, v, (n,), device="cuda"); t[0] = v - 1
    loss, dz = ce.cross_entropy_fwd(x, t, -100, 0.1, "mean", True)
    torch.cuda.synchronize()
    print(n, v, dt, float(y.float().sum(-1).mean()), float(dx.float().sum(-1).abs().max()), float(loss), bool(dz.isfinite().all()))
