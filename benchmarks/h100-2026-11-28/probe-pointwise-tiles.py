"""Decode-sized pointwise kernels (one token: 14336 and 28672 elements, bf16): GPU µs replayed from CUDA
graphs for each tile and warp count, against torch.compile of the same math."""
import itertools, torch, torch.nn.functional as F
from kpt.benchmark import graph_ms
from kpt_triton import activations as A
chosen = {}
real_spread = A.spread
def forced(n, block, epw, dev):
    return chosen["cfg"] if "cfg" in chosen else real_spread(n, block, epw, dev)
A.spread = forced
def gelu(t): return F.gelu(t)
ref = {("silu", False): F.silu, ("gelu", False): F.gelu, ("silu", True): lambda g, u: F.silu(g) * u,
       ("gelu", True): lambda g, u: F.gelu(g) * u}
compiled = {k: torch.compile(f) for k, f in ref.items()}
print("| act | gated | n | mode | default (tile, epw) µs | best (tile, epw) µs | compile µs |")
print("|---|---|---|---|---|---|---|")
for (act, gated), n in itertools.product([("silu", False), ("gelu", False), ("silu", True), ("gelu", True)], (14336, 28672)):
    x = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(x) if gated else None
    dy = torch.randn_like(x)
    for mode in ("fwd", "fwd+bwd"):
        if mode == "fwd":
            run = lambda: A._forward(act, x, up, 8192, 512)
            cargs = (x, up) if gated else (x,)
            cfn = lambda: compiled[(act, gated)](*cargs)
        else:
            run = lambda: (A._forward(act, x, up, 8192, 512), A._backward(act, x, up, dy, 8192, 512))
            xg = x.clone().requires_grad_(); ug = up.clone().requires_grad_() if gated else None
            leaves = (xg, ug) if gated else (xg,)
            cfn = lambda: torch.autograd.grad(compiled[(act, gated)](*leaves), leaves, dy)
        chosen.pop("cfg", None)
        default_cfg = real_spread(n, 8192, 512, x.device)
        t_default = graph_ms(run, rep=10) * 1e3
        results = {}
        for tile in (256, 512, 1024, 2048, 4096):
            for epw in (64, 128, 256, 512, 1024):
                w = tile // epw
                if w < 1 or w > 8:
                    continue
                chosen["cfg"] = (tile, epw)
                results[(tile, epw)] = graph_ms(run, rep=10) * 1e3
        chosen.pop("cfg", None)
        best = min(results, key=results.get)
        cfn()
        t_c = graph_ms(cfn, rep=10) * 1e3
        top = sorted(results.items(), key=lambda kv: kv[1])[:4]
        print(f"| {act} | {gated} | {n} | {mode} | {default_cfg} {t_default:.2f} | {best} {results[best]:.2f} | {t_c:.2f} | top4 {[(k, round(v, 2)) for k, v in top]}", flush=True)
