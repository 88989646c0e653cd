"""FP8 scaling as HLS designs: ``quantize_fp8``, ``dequantize_fp8``, ``fp8_linear``.

These compute in their own formats in every mode: float32 scales, FP8 minifloats
(`kpt_fpga_sim.formats.Minifloat`, round to nearest even, saturating).

    quantize:    amax pass (|x|, a comparison per element: per row in a DATAFLOW over rows, or
                 over the whole tensor before a second pass); scale = amax / fp8_max with the
                 reciprocal unit computing 1/scale once; then per element
                 xq = fp8(saturate(x · (1/scale)))                 (cvt: a float → FP8 rounder)
    dequantize:  y = float(xq) · scale                               one pipelined loop
    fp8_linear:  acc += float(xq) · float(wq) over K                 the MAC array of `linear`,
                 each MAC an exact 4×4-bit (e4m3) product feeding an fadd (``mac8``);
                 epilogue y = acc · x_scale · w_scale + bias

Multiplying by the reciprocal of the scale (one division per row, not per element) may round
x / scale one float32 ULP differently, which changes an FP8 result only at a rounding tie.
"""

from __future__ import annotations

import math

import torch

from kpt.spec import rows

from ..formats import MINIFLOATS
from ..hls import Design, region
from ..sim import Call, Pass, current, flops, matmul, row_design, stream


def quantize_fp8_fwd(x, granularity, fp8_dtype):
    a = current().arith
    fmt = MINIFLOATS[fp8_dtype]
    xv = a.load(x, "x")
    mag = xv.abs()
    if granularity == "row":
        amax = mag.amax(-1, keepdim=True) if x.shape[-1] else mag.new_zeros(*x.shape[:-1], 1)
    else:
        amax = mag.amax() if x.numel() else mag.new_zeros(())
    scale = amax / a.const(fmt.max)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a NaN amax stays NaN (the contract)
    # below 2^-128 (a row of subnormals) 1/scale overflows float32: such a scale and x are first
    # shifted up by 2^64, an exact power of two
    shifted = scale < 2.0**-64
    q = torch.where(shifted, xv * a.recip(scale * 2.0**64) * 2.0**64, xv * a.recip(scale))
    xq = fmt.quantize(q).to(fp8_dtype).contiguous()
    return xq, a.out(scale, torch.float32)


def dequantize_fp8_fwd(xq, scale, dtype):
    a = current().arith
    return a.out(a.load(xq, "xq") * a.load(scale, "scale"), dtype)


def fp8_linear_fwd(xq, x_scale, wq, w_scale, bias, out_dtype):
    a = current().arith
    acc = a.load(rows(xq), "xq") @ a.load(wq, "wq").mT
    sx = a.load(rows(x_scale) if x_scale.dim() else x_scale, "x_scale")
    y = acc * sx * a.load(w_scale, "w_scale").reshape(1, -1)
    if bias is not None:
        y = y + a.load(bias, "bias")
    return a.out(y, out_dtype).reshape(*xq.shape[:-1], wq.shape[0])


def quantize_fp8_design(call: Call, x, granularity, fp8_dtype):
    n = x.numel()
    d = x.shape[-1]
    traffic = call.io_bytes(x) + n + 4 * (n // max(d, 1))
    work = flops("quantize_fp8", (x, granularity, fp8_dtype))
    passes = [Pass("amax", {"cmp": 1}, ("cmp",), reduce="cmp"),
              Pass("convert", {"mul": 1, "cvt": 1}, ("mul", "cvt"))]
    if granularity == "row":
        return row_design(call, "quantize_fp8", n // max(d, 1), d, passes, {"mul": 1, "recip": 1},
                          ("mul", "recip"), traffic, work)
    lanes = call.lanes(traffic / max(n, 1))
    stages = [stream(call, p.name, n, lanes, p.ops, p.chain) for p in passes]
    # the whole tensor's amax is needed before the first conversion: the passes cannot overlap
    return Design("quantize_fp8", region("quantize_fp8", stages, dataflow=False), (),
                  traffic + call.io_bytes(x), work)


def dequantize_fp8_design(call: Call, xq, scale, dtype):
    n = xq.numel()
    traffic = n + call.io_bytes(scale) + n * torch.empty(0, dtype=dtype).element_size()
    lanes = call.lanes(traffic / max(n, 1))
    loop = stream(call, "dequantize", n, lanes, {"cvt": 1, "mul": 1}, ("cvt", "mul"))
    return Design("dequantize_fp8", loop, (), traffic, flops("dequantize_fp8", (xq, scale, dtype)))


def fp8_linear_design(call: Call, xq, x_scale, wq, w_scale, bias, out_dtype):
    m = math.prod(xq.shape[:-1])
    n, k = wq.shape
    mac, buffers, operand_bytes, t = matmul(call, "mac", m, n, k, mac="mac8", in_bits=8, in_bytes=1)
    lanes = max(1, math.ceil(t.tm * t.tn / max(k, 1)))
    epilogue = stream(call, "epilogue", m * n, lanes, {"mul": 2, "add": bias is not None},
                      ("mul", "mul", "add"))
    out_bytes = torch.empty(0, dtype=out_dtype).element_size()
    traffic = operand_bytes + call.io_bytes(x_scale, w_scale, bias) + out_bytes * m * n
    top = region("fp8_linear", [mac, epilogue], dataflow=call.directives.dataflow)
    return Design("fp8_linear", top, buffers, int(traffic),
                  flops("fp8_linear", (xq, x_scale, wq, w_scale, bias, out_dtype)), roof_op="mac8")
