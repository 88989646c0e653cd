"""kpt-cuda's attention (NVIDIA's fused kernels on Hopper), forward and backward, against the float64
reference and beside F.scaled_dot_product_attention's own error, at shapes that take each route
(cuDNN, cuDNN with the causal mask as a bias, FlashAttention-2, one query and key), bf16 and fp16:

    python3 scripts/attention_check.py      # on a GPU; one line per shape and dtype

Each line gives the routes of the forward and the backward (`kpt_cuda.attention._library`) and the
relative error (‖got − reference‖ / ‖reference‖) of o, dq, dk and dv for kpt and for SDPA.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

import kpt
from kpt_cuda import attention as routes

SHAPES = [  # B, Hq, Hkv, Sq, Skv, D, causal
    (2, 8, 8, 256, 256, 64, True), (2, 8, 2, 256, 256, 128, True), (1, 8, 8, 300, 300, 128, False),
    (2, 4, 4, 128, 128, 256, True), (2, 8, 2, 1, 700, 128, True), (2, 8, 2, 8, 1000, 128, True),
    (1, 8, 8, 100, 333, 64, False), (2, 16, 4, 513, 513, 64, True), (1, 4, 1, 64, 64, 96, True),
    (16, 16, 4, 8, 1024, 128, True), (16, 16, 4, 64, 2048, 128, False), (2, 2, 2, 1, 1, 64, False),
    (16, 16, 4, 24, 1000, 64, True),
]


def _grads(fn, inputs, do, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
    o = fn(q, k, v)
    o.backward(do.to(dtype))
    return [o.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


def _errors(got, expected):
    return " ".join(f"{(x - e).norm().item() / max(e.norm().item(), 1e-30):.1e}" for x, e in zip(got, expected))


def _sdpa(q, k, v, causal, scale):
    sq, skv = q.shape[2], k.shape[2]
    mask = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(skv - sq) if causal and sq != skv else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and sq == skv, scale=scale,
                                          enable_gqa=True)


def _check(cuda, ref, dtype, b, hq, hkv, sq, skv, d, causal) -> str:
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    kw = {"causal": causal, "scale": 1 / math.sqrt(d)}
    expected = _grads(functools.partial(ref.attention, **kw), (q, k, v), do, torch.float64)
    got = _grads(functools.partial(cuda.attention, **kw), (q, k, v), do, dtype)
    base = _grads(functools.partial(_sdpa, **kw), (q, k, v), do, dtype)
    route = (routes._library(q, k, causal, kw["scale"]), routes._library(q, k, causal, kw["scale"], backward=True))
    nan = "  NaN!" if any(not bool(torch.isfinite(x).all()) for x in got) else ""
    return f"{route}  kpt o/dq/dk/dv {_errors(got, expected)}  sdpa {_errors(base, expected)}{nan}"


def main() -> None:
    cuda, ref = kpt.get_backend("cuda"), kpt.get_backend("reference")
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for shape in SHAPES:
            b, hq, hkv, sq, skv, d, causal = shape
            name = f"B{b} H{hq}/{hkv} Sq{sq} Skv{skv} D{d} {'causal' if causal else 'full'} {str(dtype)[6:]}"
            try:
                print(f"{name:48s} {_check(cuda, ref, dtype, *shape)}")
            except Exception as exc:  # report the shape and go on to the next one
                print(f"{name:48s} FAILED {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()
