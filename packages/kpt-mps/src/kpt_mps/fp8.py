"""Float8 bodies (``shaders/fp8.metal``): quantize, dequantize, and ``fp8_linear`` (operands
decoded to float32 in the kernel, torch's matmul, the scales and bias in the epilogue)."""

from __future__ import annotations

import torch

from kpt.spec import rows as flat

from . import metal


def _max(fp8_dtype):
    return int(torch.finfo(fp8_dtype).max)


def quantize_fp8_fwd(x, granularity, fp8_dtype):
    xc = x.contiguous()
    width = xc.shape[-1] if granularity == "row" else xc.numel()
    groups = xc.numel() // width if width else 0
    scale_shape = (*x.shape[:-1], 1) if granularity == "row" else ()
    scale = torch.ones(scale_shape, dtype=torch.float32, device=x.device).contiguous()
    metal.rows("fp8", "fp8_scale", [xc, scale, metal.ints(width, metal.code(x), _max(fp8_dtype), like=x)], groups)
    xq = torch.empty(xc.shape, dtype=torch.uint8, device=x.device)
    metal.elements("fp8", "fp8_quantize",
                   [xc, scale, xq, metal.ints(xc.numel(), max(width, 1), metal.code(x), metal.CODES[fp8_dtype],
                                              _max(fp8_dtype), like=x)], xc.numel())
    return xq.view(fp8_dtype), scale


def _dequantize(xq, scale, width, dtype):
    y = torch.empty(xq.shape, dtype=dtype, device=xq.device)
    metal.elements("fp8", "fp8_dequantize",
                   [metal.buffer(xq, xq), scale.float().contiguous(), y,
                    metal.ints(xq.numel(), max(width, 1), metal.code(xq), metal.code(y), like=xq)], xq.numel())
    return y


def dequantize_fp8_fwd(xq, scale, dtype):
    return (_dequantize(xq, scale, xq.shape[-1] if scale.dim() else xq.numel(), dtype),)


def fp8_linear_fwd(xq, x_scale, wq, w_scale, bias, out_dtype):
    one = torch.ones(1, dtype=torch.float32, device=xq.device)
    x32 = _dequantize(flat(xq), one, flat(xq).numel(), torch.float32)
    w32 = _dequantize(wq, one, wq.numel(), torch.float32)
    acc = (x32 @ w32.T).contiguous()
    y = torch.empty(acc.shape, dtype=out_dtype, device=xq.device)
    metal.elements("fp8", "fp8_linear_epilogue",
                   [acc, x_scale.contiguous(), w_scale.contiguous(), metal.buffer(bias, xq), y,
                    metal.ints(acc.numel(), acc.shape[1], x_scale.dim() > 0, w_scale.dim() > 0, metal.code(bias),
                               metal.code(y), like=xq)], acc.numel())
    return (y.reshape(*xq.shape[:-1], wq.shape[0]),)
