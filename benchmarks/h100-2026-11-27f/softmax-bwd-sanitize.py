import torch
from kpt_cuda import onchip, softmax as native
onchip.MIN_ROWS_PER_SM = 0
native.BACKWARD_MIN_WIDTH = 0
for n, v, pad, dt in [(300, 50257, 8, torch.bfloat16), (133, 32001, 0, torch.float16), (9, 40003, 4, torch.float32),
                      (140, 128255, 0, torch.bfloat16), (5, 20, 0, torch.bfloat16), (3, 151937, 0, torch.float16)]:
    x = torch.randn(n, v, device="cuda").to(dt)
    y = torch.softmax(x.float(), -1).to(dt)
    dy = torch.randn(n, v + pad, device="cuda").to(dt)[:, :v]
    (dx,) = native.softmax_bwd(x, 1, y, dy, max_block=16)
    torch.cuda.synchronize()
    print(n, v, dt, float(dx.float().sum(-1).abs().max()))
