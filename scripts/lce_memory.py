"""Peak memory and time of linear_cross_entropy, fused (kpt) against unfused (linear, then CE).

    python3 scripts/lce_memory.py [--backend cuda]                                  # the issue's shape
    python3 scripts/lce_memory.py --shape 16384,768,151936 --chunk-rows 384,1024    # Qwen3's head

Forward and backward in bfloat16 at ``--shape`` N,K,V (default N=8192, K=4096, V=128256): the
backend's call as a model makes it, eager ``F.linear`` then ``F.cross_entropy``, the same under
``torch.compile``, Liger-Kernel's fused loss where it is installed, and, for each of
``--chunk-rows``, kpt-triton's fused body with chunks of that many
rows (otherwise `kpt_triton.cross_entropy.chunk_rows` picks them, at most the room of the
gradients). A chunk's gradient of the weight is
added into the V x K gradient in place, which reads and writes it once a chunk: (N / rows) x 4VK
bytes a step, against the chunk's three products, so fewer rows cost time and more rows memory.
Peak memory is what the step allocates beyond its inputs (torch.cuda.max_memory_allocated after a
reset), and its working memory: that peak less the tensors the step returns (the gradients of
hidden and weight, which every method allocates; issue 49 compares this one). Times are the median
of device events (`kpt.bench.timing.time_ms`). Each line also gives
the weight-gradient traffic at the copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import kpt
from kpt.bench.timing import time_ms


def _measure(step: Callable[[], Any], device: torch.device) -> tuple[float, float, float]:
    """(peak GiB allocated beyond what was allocated before, that peak less the GiB of the tensors
    ``step`` returns, median ms) of ``step``."""
    step()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = step()
    torch.cuda.synchronize(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    returned = sum(t.untyped_storage().nbytes() for t in out if isinstance(t, torch.Tensor)) / 2**30
    del out
    return peak, peak - returned, time_ms(step, device)


def _copy_gbps(device: torch.device) -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--shape", default="8192,4096,128256", help="N,K,V: rows, hidden size, vocabulary")
    parser.add_argument("--chunk-rows", default="", help="kpt-triton's fused body with these rows a chunk")
    opts = parser.parse_args()
    be = kpt.get_backend(opts.backend)
    n, k, v = (int(x) for x in opts.shape.split(","))
    dev = torch.device("cuda")
    hidden = (torch.randn(n, k, device=dev) * 0.5).bfloat16().requires_grad_(True)
    weight = (torch.randn(v, k, device=dev) * 0.02).bfloat16().requires_grad_(True)
    target = torch.randint(0, v, (n,), device=dev)
    copy = _copy_gbps(dev)
    print(f"N={n} K={k} V={v} bfloat16; copy {copy:.0f} GB/s", flush=True)

    def fused() -> Any:
        loss = be.linear_cross_entropy(hidden, weight, target)
        return torch.autograd.grad(loss, (hidden, weight))

    def unfused() -> Any:
        loss = F.cross_entropy(F.linear(hidden, weight).float(), target)
        return torch.autograd.grad(loss, (hidden, weight))

    # name -> (step, rows a chunk where the step fixes them)
    steps: dict[str, tuple[Callable[[], Any], int | None]] = {
        "kpt (backend call)": (fused, None), "eager": (unfused, None), "torch.compile": (torch.compile(unfused), None)}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        print("Liger-Kernel: not installed", flush=True)
    else:
        def liger() -> Any:
            loss = liger_fused_linear_cross_entropy(hidden, weight, target)
            return torch.autograd.grad(loss, (hidden, weight))

        steps["Liger-Kernel"] = (liger, None)
    if opts.chunk_rows:
        from kpt_triton.cross_entropy import linear_cross_entropy_fwd

        for rows in (int(r) for r in opts.chunk_rows.split(",")):
            steps[f"kpt-triton, {rows} rows a chunk"] = (
                lambda rows=rows: linear_cross_entropy_fwd(hidden.detach(), weight.detach(), target, None, -100,
                                                           "mean", True, chunk_elems=rows * v,
                                                           gradient_share=float("inf"))[:3], rows)
    results = {}
    for name, (step, rows) in steps.items():
        peak, working, ms = results[name] = _measure(step, dev)
        traffic = f"; weight-gradient traffic {n / rows * 4 * v * k / copy / 1e6:.2f} ms at copy" if rows else ""
        print(f"{name}: peak {peak:.2f} GiB above inputs ({working:.3f} GiB beyond what it returns), "
              f"fwd+bwd {ms:.2f} ms{traffic}", flush=True)
    f, u = results["kpt (backend call)"], results["eager"]
    print(f"fused/unfused: memory {f[0] / u[0]:.1%} (target < 25%), time {f[2] / u[2]:.2f}x (target <= 1.1x)")


if __name__ == "__main__":
    main()
