"""Masked attention on a Hopper GPU: kpt-cuda with a mask (cuDNN with the mask as an additive bias),
beside the same call on the portable Triton kernels, SDPA with the boolean mask, and the unmasked
causal call of both, forward and forward + backward, bf16:

    python3 scripts/bench_masked_attention.py results/masked_attention.json

Masks: the whole causal mask transformers builds under ``torch.compile`` for a batch with an
attention mask (``mask_causal``: nothing is hidden beyond causality), and left padding of half the
rows by an eighth of the length as a whole mask (``mask_pad``: those padding queries see no key)
and as the ``[B, 1, 1, S]`` key padding under the causal flag that kpt.patch gives a padded batch
(``keypad``: a bias broadcast over the queries). Times are medians
of ``triton.testing.do_bench``; TFLOP/s count a causal call's FLOPs (backward 2.5 times the
forward's). Also printed: the largest difference between cuDNN with kpt's causal flag and bias and
cuDNN with the bias alone, and whether any output is NaN.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton.testing

import kpt
from kpt_cuda import attention as routes

SHAPES = [(8, 12, 4, 2048, 64), (4, 32, 8, 4096, 128), (16, 16, 4, 1024, 64)]  # B, Hq, Hkv, S, D


def timed(fn, grads) -> dict[str, float]:
    q, k, v, do = grads

    def step() -> None:
        torch.autograd.grad(fn(), (q, k, v), do)

    fwd = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    both = triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median")
    b, hq, s, d = q.shape
    flops = 4 * b * hq * s * s * d / 2
    return {"fwd_ms": round(fwd, 4), "fwdbwd_ms": round(both, 4), "fwd_tflops": round(flops / fwd / 1e9, 1),
            "fwdbwd_tflops": round(3.5 * flops / both / 1e9, 1)}


def one_shape(be: kpt.Backend, b: int, hq: int, hkv: int, s: int, d: int) -> dict[str, object]:
    g = torch.Generator("cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = (rand(b, h, s, d).requires_grad_() for h in (hq, hkv, hkv))
    grads = (q, k, v, rand(b, hq, s, d))
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").tril().expand(b, 1, s, s).contiguous()
    pad = causal.clone()
    pad[: b // 2, :, :, : s // 8] = False  # left padding: those keys hidden,
    pad[: b // 2, :, : s // 8, :] = False  # and the padding queries see no key
    keys = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
    keys[: b // 2, ..., : s // 8] = False  # the same padding as kpt.patch gives it: the keys only
    row: dict[str, object] = {
        "kpt_nomask": timed(lambda: be.attention(q, k, v, causal=True), grads),
        "kpt_mask_causal": timed(lambda: be.attention(q, k, v, causal=True, mask=causal), grads),
        "kpt_mask_pad": timed(lambda: be.attention(q, k, v, causal=True, mask=pad), grads),
        "kpt_keypad": timed(lambda: be.attention(q, k, v, causal=True, mask=keys), grads)}
    library = routes._library
    routes._library = lambda *a, **kw: None  # every call (all masked here) on the portable kernels
    try:
        row["portable_mask_causal"] = timed(lambda: be.attention(q, k, v, causal=True, mask=causal), grads)
    finally:
        routes._library = library
    rep = hq // hkv
    row["sdpa_boolmask"] = timed(lambda: F.scaled_dot_product_attention(  # heads repeated, as for a masked call
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=causal), grads)
    row["sdpa_causal"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), grads)
    with torch.no_grad():
        o = be.attention(q, k, v, causal=True, mask=pad)
        bias = routes._mask_bias(pad.expand(b, hq, s, s), q.dtype)
        kk, vv = (t.repeat_interleave(rep, 1).contiguous() for t in (k, v))
        bias_only = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, kk, vv, bias, True, 0.0, False, False, scale=d ** -0.5)[0]
        sees = pad.any(-1).unsqueeze(-1)
        row["max_diff_causalflag_vs_biasonly"] = float((o - bias_only.masked_fill(~sees, 0)).abs().max())
        row["nan_in_o"] = bool(o.isnan().any())
    return row


def main(out: str) -> None:
    be = kpt.get_backend("cuda")
    results = {}
    for b, hq, hkv, s, d in SHAPES:
        name = f"B{b} H{hq}/{hkv} S{s} D{d}"
        results[name] = one_shape(be, b, hq, hkv, s, d)
        print(json.dumps({name: results[name]}), flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "masked_attention.json")
