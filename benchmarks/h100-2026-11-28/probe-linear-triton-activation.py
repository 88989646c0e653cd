"""(Run with linear-triton-activation-not-kept.patch applied.) linear with an activation, no gradient: kpt-triton's activation kernel (new) against torch's pointwise kernel
(old), beside cuBLAS+act and torch.compile of it. GPU µs replayed from CUDA graphs, GPU µs with the L2 flushed,
host µs of back-to-back calls; outputs compared bit for bit with the old path."""
import sys, torch, torch.nn.functional as F
import kpt
from kpt.benchmark import graph_ms, host_us, time_ms
from kpt_triton import products
be = kpt.get_backend("cuda")
acts = {None: lambda t: t, "relu": F.relu, "gelu": F.gelu, "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
new_act = products.activation_fwd
old_act = lambda pre, a: products.ACTIVATIONS[a](pre)
def cublas_act(x, w, b, a): return acts[a](F.linear(x, w, b))
compiled = torch.compile(cublas_act)
print("| M×N×K | act | graphs new | old | cuBLAS+act | compile | new/best | flushed new | old | cuBLAS+act | compile | host new | old | cuBLAS+act | same bits |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
N, K = 14336, 4096
w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
for m in (1, 16, 128, 1024, 4096, 16384):
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    for a in ("silu", "gelu", "gelu_tanh", "relu"):
        outs = {}
        g, fl, h = {}, {}, {}
        for v in ("new", "old"):
            products.activation_fwd = new_act if v == "new" else old_act
            call = lambda: be.linear(x, w, None, activation=a)
            outs[v] = call().clone()
            g[v] = graph_ms(call, rep=40) * 1e3
            fl[v] = time_ms(call, x.device, rep=60) * 1e3
            h[v] = host_us(call, calls=200) if m <= 128 else float("nan")
        products.activation_fwd = new_act
        for v, fn in (("cublas", lambda: cublas_act(x, w, None, a)), ("compile", lambda: compiled(x, w, None, a))):
            fn()
            g[v] = graph_ms(fn, rep=40) * 1e3
            fl[v] = time_ms(fn, x.device, rep=60) * 1e3
            h[v] = host_us(fn, calls=200) if m <= 128 else float("nan")
        same = torch.equal(outs["new"].view(torch.int16), outs["old"].view(torch.int16))
        maxdiff = (outs["new"].float() - outs["old"].float()).abs().max().item()
        print(f"| {m}×{N}×{K} | {a} | {g['new']:.2f} | {g['old']:.2f} | {g['cublas']:.2f} | {g['compile']:.2f} | "
              f"{min(g['cublas'], g['compile'], g['old']) / g['new']:.3f} | {fl['new']:.1f} | {fl['old']:.1f} | {fl['cublas']:.1f} | "
              f"{fl['compile']:.1f} | {h['new']:.1f} | {h['old']:.1f} | {h['cublas']:.1f} | {same} (max {maxdiff:.3g}) |", flush=True)
    del x
# 3-D input and a bias, one token (a decode step's shape)
x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16); b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
for v in ("new", "old"):
    products.activation_fwd = new_act if v == "new" else old_act
    call = lambda: be.linear(x, w, b, activation="silu")
    print(f"3-D + bias silu {v}: graphs {graph_ms(call, rep=40)*1e3:.2f} µs, host {host_us(call, calls=500):.1f} µs")
fn = lambda: compiled(x, w, b, "silu"); fn()
print(f"3-D + bias silu compile: graphs {graph_ms(fn, rep=40)*1e3:.2f} µs, host {host_us(fn, calls=500):.1f} µs")
fn = lambda: cublas_act(x, w, b, "silu")
print(f"3-D + bias silu cuBLAS+act: graphs {graph_ms(fn, rep=40)*1e3:.2f} µs, host {host_us(fn, calls=500):.1f} µs")
