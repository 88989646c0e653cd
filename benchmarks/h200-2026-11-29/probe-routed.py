"""kpt-cuda's warp-specialized forward through the backend: forward + backward against a float32
reference at routed shapes, then GPU time (10 back-to-back calls a sample, 5 interleaved rounds)
against FlashAttention-2, the portable forward with Hopper tiles, and the host time of a call."""
import statistics, time
import torch
import kpt
import kpt_cuda.attention as C
from kpt_cuda.tuning import SM90_HBM3E

torch.manual_seed(0)
be = kpt.get_backend("cuda")
T = SM90_HBM3E["attention_fwd"]
aten = torch.ops.aten


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


bad = 0
for dt in (torch.bfloat16, torch.float16):
    for b, hq, hkv, sq, skv, layout in [(1, 32, 8, 2048, 4096, "bhsd"), (2, 16, 4, 1600, 4000, "bshd"),
                                        (1, 32, 8, 1111, 7777, "bshd"), (4, 16, 16, 1024, 3000, "bhsd"), (1, 32, 8, 2000, 2010, "bshd")]:
        mk = (lambda *s: torch.randn(s[0], s[2], s[1], s[3], device="cuda", dtype=dt).transpose(1, 2)) if layout == "bshd" \
            else (lambda *s: torch.randn(*s, device="cuda", dtype=dt))
        q, k, v, do = mk(b, hq, sq, 128), mk(b, hkv, skv, 128), mk(b, hkv, skv, 128), torch.randn(b, hq, sq, 128, device="cuda", dtype=dt)
        lib = C._library(q, k, True, 128 ** -0.5, tiles=T["tiles"], warp_specialized=T["warp_specialized"])
        q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = be.attention(q1, k1, v1, causal=True)
        o.backward(do)
        q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
        mask = torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril(skv - sq)
        o2 = torch.nn.functional.scaled_dot_product_attention(q2, k2.repeat_interleave(hq // hkv, 1),
                                                              v2.repeat_interleave(hq // hkv, 1), attn_mask=mask)
        o2.backward(do.float())
        errs = [rel(o, o2), rel(q1.grad, q2.grad), rel(k1.grad, k2.grad), rel(v1.grad, v2.grad)]
        ok = lib == "warp-specialized" and all(bool(t.isfinite().all()) for t in (o, q1.grad, k1.grad, v1.grad)) \
            and max(errs) < (2e-2 if dt == torch.bfloat16 else 5e-3)
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {dt} B{b} H{hq}/{hkv} Sq{sq} Skv{skv} {layout}: route={lib} rel err o/dq/dk/dv "
              + " ".join(f"{e:.2e}" for e in errs), flush=True)
        del q1, k1, v1, q2, k2, v2, o, o2
print("fwd+bwd through the backend:", "all ok" if not bad else f"{bad} BAD", flush=True)


def gpu_time(fn, n=10):
    a, e = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n):
        fn()
    e.record(); e.synchronize()
    return a.elapsed_time(e) / n


def compare(label, flops, fns, base, rounds=5):
    for fn in fns.values():
        fn(); fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(gpu_time(fn))
    line = [label]
    for name, ts in times.items():
        ratio = statistics.median(t0 / t for t0, t in zip(times[base], ts))
        line.append(f"{name} {statistics.median(ts) * 1e3:.0f} us {flops / statistics.median(ts) / 1e9:.0f} TF/s ({ratio:.2f}x {base})")
    print(" | ".join(line), flush=True)


for b, hq, hkv, sq, skv in [(1, 32, 8, 4096, 16384), (1, 32, 8, 2048, 65536), (1, 32, 8, 4096, 8192),
                            (2, 32, 8, 2048, 4096), (4, 32, 8, 4096, 32768), (1, 32, 8, 1024, 16384),
                            (1, 32, 8, 1000, 9000), (1, 32, 8, 640, 16384), (1, 32, 8, 768, 12288),
                            (1, 32, 8, 1152, 4608), (2, 32, 8, 512, 8192), (4, 32, 8, 2048, 2560)]:
    q = torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, skv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, skv, 128, device="cuda", dtype=torch.bfloat16)
    s = 128 ** -0.5
    flops = 4 * b * hq * (sq * skv - sq * (sq - 1) / 2) * 128
    lib = C._library(q, k, True, s, tiles=T["tiles"], warp_specialized=T["warp_specialized"])
    fns = {"flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=s),
           f"kpt-cuda ({lib})": lambda: C.attention_fwd(q, k, v, True, s, **T),
           "warp-specialized": lambda: C.warp_specialized_fwd(q, k, v, True, s, T["warp_specialized"]),
           "portable tiles": lambda: C.portable.attention_fwd(q, k, v, True, s, tiles=T["tiles"])}
    compare(f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} ({b * hq * -(-sq // 128)} tiles)", flops, fns, "flash")

q = torch.randn(1, 32, 256, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
for name, fn in [("warp_specialized_fwd", lambda: C.warp_specialized_fwd(q, k, k, True, 0.1, T["warp_specialized"])),
                 ("flash", lambda: aten._scaled_dot_product_flash_attention(q, k, k, 0.0, True, False, scale=0.1)),
                 ("portable", lambda: C.portable.attention_fwd(q, k, k, True, 0.1, tiles=T["tiles"]))]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        fn()
    host = (time.perf_counter() - t0) / 200
    torch.cuda.synchronize()
    print(f"host time a call, {name}: {host * 1e6:.1f} us (B1 H32/8 Sq256 Skv1024)", flush=True)
