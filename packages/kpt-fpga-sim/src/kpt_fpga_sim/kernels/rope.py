"""Rotary position embedding as an HLS design: ``rope`` (rotate-half convention).

    for each (b, h, s) row of q then of k, D/2 pairs, U lanes   PIPELINE II=reuse
        out[j]       = t[j] · cos[j]       − t[j + D/2] · sin[j]
        out[j + D/2] = t[j + D/2] · cos[j + D/2] + t[j] · sin[j + D/2]

cos/sin rows stream from off-chip memory once per sequence position and batch, and are held
on chip for all the heads. Backward: dt = dout · cos − rotate_half(dout · sin).
"""

from __future__ import annotations

from ..hls import Buffer, Design
from ..sim import Call, current, flops, stream, zeros


def _rotate_half(a, t):
    half = t.shape[-1] // 2
    return a.cat([-t[..., half:], t[..., :half]], -1)


def _tables(a, cos, sin):
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return a.load(cos, "cos"), a.load(sin, "sin")


def rope_fwd(q, k, cos, sin):
    a = current().arith
    c, s = _tables(a, cos, sin)

    def rotate(t, name):
        v = a.load(t, name)
        return a.out(a.cast(v * c + _rotate_half(a, v) * s, f"{name}_out"), t.dtype)

    return rotate(q, "q"), rotate(k, "k")


def rope_bwd(q, k, cos, sin, q_out, k_out, dq_out, dk_out):
    a = current().arith
    c, s = _tables(a, cos, sin)

    def back(t, d, name):
        if d is None:
            return zeros(t)
        dv = a.load(d, f"d{name}_out")
        return a.out(a.cast(dv * c - _rotate_half(a, a.cast(dv * s, f"d{name}·sin", a.wide)), f"d{name}"),
                     t.dtype)

    return back(q_out, dq_out, "q"), back(k_out, dk_out, "k")  # q, k: None (not saved)


def _design(call: Call, q, k, cos, work: float, grads: int) -> Design:
    n = q.numel() + k.numel()
    traffic = call.io_bytes(q, k, q, k) * grads + 2 * call.io_bytes(cos)
    lanes = call.lanes(traffic / max(n, 1))
    loop = stream(call, "rotate", n, lanes, {"mul": 2, "add": 1}, ("mul", "add"),
                  {"cos/sin rows": 2, "row": 2})
    d = q.shape[-1]
    buffers = (Buffer("cos/sin rows", 2 * call.data_bits, d, call.banks(2 * lanes), 2),
               Buffer("row", call.data_bits, d, call.banks(2 * lanes), 2))
    return Design("rope", loop, buffers, traffic, work)


def rope_design(call: Call, q, k, cos, sin):
    return _design(call, q, k, cos, flops("rope", (q, k, cos, sin)), 1)


def rope_bwd_design(call: Call, q, k, cos, sin, q_out, k_out, *grads):
    # q, k are not saved for the backward (None): the outputs have their shapes
    return _design(call, q_out, k_out, cos, flops("rope", (q_out, k_out, cos, sin)), 1)
