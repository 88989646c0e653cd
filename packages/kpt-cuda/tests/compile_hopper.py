"""Compile kpt-cuda's warp-specialized attention forward for sm_90a without a GPU; print its
registers, spilled bytes, shared memory and ``setmaxnreg`` count as JSON.

    python compile_hopper.py CAUSAL DTYPE SQ SKV     # True|False bfloat16|float16 lengths
"""

import json
import sys

import torch
import triton
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from kpt_cuda import attention, tuning
from kpt_triton.aot import TARGETS, _ptxas, _resources

causal, dtype, sq, skv = sys.argv[1] == "True", getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
target = TARGETS["sm90"].gpu
backend = make_backend(target)
plan = tuning.SM90_HBM3E["attention_fwd"]["warp_specialized"]
q = torch.empty(2, sq, 8, 128, dtype=dtype).transpose(1, 2)  # [B, H, S, D] with the heads interleaved
k = torch.empty(2, 2, skv, 128, dtype=dtype)
o = torch.empty(2, 8, sq, 128, dtype=dtype)
descriptors = (attention._descriptor(q, attention.WS_ROWS), attention._descriptor(k, attention.WS_BLOCK_N),
               attention._descriptor(k, attention.WS_BLOCK_N), attention._descriptor(o, attention.WS_ROWS))
fn = attention._attn_fwd_ws
kwargs = {"CAUSAL": causal, "STAGES": plan.stages, "CONSUMER_REGS": plan.consumer_regs,
          "PRODUCER_REGS": plan.producer_regs, "num_warps": 4}
bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(
    *descriptors, torch.empty(2, 8, sq), torch.empty(1, dtype=torch.int32), 8, 4, sq, skv, attention._ws_tiles(q),
    attention._section_heads(q, k, plan), 0.1, **kwargs)
options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
compiled = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
ptx = compiled.asm["ptx"]
registers, spills = _resources(_ptxas(ptx, TARGETS["sm90"]))
print(json.dumps({"registers": registers, "spills": spills, "shared": compiled.metadata.shared,
                  "setmaxnreg": ptx.count("setmaxnreg")}))
