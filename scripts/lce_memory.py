"""Peak memory and time of linear_cross_entropy, fused (kpt) against unfused (linear, then CE).

    python3 scripts/lce_memory.py [--backend cuda]

Forward and backward at N=8192, K=4096, V=128256 in bfloat16 (the issue's shape). Peak memory is
what the step allocates beyond its inputs (torch.cuda.max_memory_allocated after a reset).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import kpt
from kpt.bench.timing import time_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cuda")
    opts = parser.parse_args()
    be = kpt.get_backend(opts.backend)
    n, k, v = 8192, 4096, 128256
    dev = torch.device("cuda")
    hidden = (torch.randn(n, k, device=dev) * 0.5).bfloat16().requires_grad_(True)
    weight = (torch.randn(v, k, device=dev) * 0.02).bfloat16().requires_grad_(True)
    target = torch.randint(0, v, (n,), device=dev)

    def fused():
        loss = be.linear_cross_entropy(hidden, weight, target)
        return torch.autograd.grad(loss, (hidden, weight))

    def unfused():
        loss = F.cross_entropy(F.linear(hidden, weight), target)
        return torch.autograd.grad(loss, (hidden, weight))

    results = {}
    for name, step in (("fused", fused), ("unfused", unfused)):
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del grads
        results[name] = (peak / 2**30, time_ms(step, dev))
        print(f"{name}: peak {results[name][0]:.2f} GiB above inputs, fwd+bwd {results[name][1]:.2f} ms", flush=True)
    f, u = results["fused"], results["unfused"]
    print(f"fused/unfused: memory {f[0] / u[0]:.1%} (target < 25%), time {f[1] / u[1]:.2f}x (target <= 1.1x)")


if __name__ == "__main__":
    main()
