"""Where the host time of a one-token kpt linear (silu) forward+backward goes, against F.linear + F.silu."""
import cProfile, pstats, io, time, torch, torch.nn.functional as F
import kpt
be = kpt.get_backend("cuda")
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = (torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
dy = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
calls = {"kpt": lambda: torch.autograd.grad(be.linear(x, w, None, activation="silu"), (x, w), dy),
         "torch": lambda: torch.autograd.grad(F.silu(F.linear(x, w)), (x, w), dy),
         "kpt fwd only": lambda: be.linear(x, w, None, activation="silu"),
         "torch fwd only": lambda: F.silu(F.linear(x, w))}
for name, run in calls.items():
    for _ in range(50): run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(300): run()
        samples.append((time.perf_counter() - t0) / 300 * 1e6)
        torch.cuda.synchronize()
    print(f"{name}: host µs per call, min {min(samples):.1f} median {sorted(samples)[3]:.1f} max {max(samples):.1f}")
pr = cProfile.Profile()
pr.enable()
for _ in range(300): calls["kpt"]()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue())
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(20): calls["kpt"]()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(20): calls["torch"]()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
