"""Decode attention (one query a sequence) on a CUDA GPU: kpt-cuda's route against each of SDPA's
backends and kpt-triton's split-KV kernel, at D 128 in bfloat16.

    python3 scripts/decode_routes.py

For each shape it prints the route `kpt_cuda.attention` picks, then for each implementation the
device time of one call replayed from a CUDA graph (``graph``: no host time), the median with
device events and the L2 cache flushed (``events``), the largest difference from float64 SDPA, and
the kernels the call launches. kpt-cuda sends a single query to cuDNN; this checks that nothing
beats it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import kpt
from kpt.bench.peers import libraries
from kpt.bench.timing import graph_ms, time_ms
from kpt_cuda import attention as routes
from kpt_triton import attention as portable

SHAPES = [(1, 32, 8, 1024), (1, 32, 8, 4096), (1, 32, 8, 32768), (1, 32, 32, 4096), (8, 32, 8, 4096)]
"""(batch, query heads, key/value heads, keys)."""


def kernels(fn: Callable[[], torch.Tensor]) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return [e.name[:40] for e in p.events() if e.device_type.name == "CUDA"]


def implementations(be: kpt.Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """The calls compared: kpt's, SDPA with each backend (`kpt bench`'s attention peers), kpt-triton's
    split-KV kernel."""
    calls: dict[str, Callable[[], torch.Tensor]] = {"kpt": lambda: be.attention(q, k, v, causal=True)}
    for name, peer in libraries("attention")[0].items():
        calls[name] = lambda peer=peer: peer(q, k, v, True, scale)
    calls["kpt-triton split-KV"] = lambda: portable.attention_fwd(q, k, v, True, scale, None)[0]
    return calls


def main() -> None:
    be = kpt.get_backend("cuda")
    dev = torch.device("cuda")
    scale = 128 ** -0.5
    for b, hq, hkv, skv in SHAPES:
        q = torch.randn(b, hq, 1, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hkv, skv, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        group = hq // hkv
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(group, 1),
                                             v.double().repeat_interleave(group, 1))
        print(f"B{b} H{hq}/{hkv} Skv{skv}: kpt routes to {routes._library(q, k, True, scale) or 'kpt-triton'}")
        for name, fn in implementations(be, q, k, v, scale).items():
            try:
                err = (fn().double() - ref).abs().max().item()
            except RuntimeError as exc:  # a backend that does not take the shape
                print(f"  {name:20s} does not run: {str(exc)[:80]}")
                continue
            print(f"  {name:20s} graph {graph_ms(fn) * 1e3:7.2f} us  events {time_ms(fn, dev) * 1e3:7.2f} us  "
                  f"max error {err:.1e}  kernels {kernels(fn)}")


if __name__ == "__main__":
    main()
