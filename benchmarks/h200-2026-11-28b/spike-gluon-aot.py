"""Compile the Gluon spike for sm_90a on a machine without a GPU: registers, spills, shared memory."""
import sys, re, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.nvidia.compiler import get_ptxas
import spike_gluon_attention as G

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)


def compile_for(causal, overlap, stages, d=128, block_n=128, num_warps=8):
    B, H, S = 1, 2, 256
    q = torch.empty(B, H, S, d, dtype=torch.bfloat16)
    k, v, o = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(B, H, S)
    qd, kd, vd, od = G.descriptors(q, k, v, o, 128, block_n)
    fn = G.gluon_attn_fwd
    args = (qd, kd, vd, od, lse, H, 1, S, S, 0.1)
    kwargs = dict(CAUSAL=causal, STAGES=stages, OVERLAP=overlap, S_INSTR_N=block_n, O_INSTR_N=d, num_warps=num_warps)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src, tempfile.TemporaryDirectory() as out:
        src.write(compiled.asm["ptx"]); src.flush()
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src.name, "-o", f"{out}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log).group(1)
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    wgmma = compiled.asm["ptx"].count("wgmma.mma_async")
    print(f"causal={causal} overlap={overlap} stages={stages} d={d} bn={block_n} w{num_warps}: regs {regs}, spills {spills}, "
          f"shared {compiled.metadata.shared}, wgmma instrs {wgmma}", flush=True)


for causal, overlap, stages in ([] if "ws" in sys.argv else [(False, False, 2), (True, False, 2), (False, True, 3), (True, True, 3)]):
    try:
        compile_for(causal, overlap, stages)
    except Exception as e:
        print(causal, overlap, stages, "FAILED", type(e).__name__, str(e)[:3000])
for kw in ([] if "ws" in sys.argv else [dict(causal=False, overlap=True, stages=4, block_n=64), dict(causal=True, overlap=False, stages=3, block_n=64),
           dict(causal=False, overlap=True, stages=3, d=64), dict(causal=True, overlap=False, stages=2, d=64)]):
    try:
        compile_for(**kw)
    except Exception as e:
        print(kw, "FAILED", type(e).__name__, str(e)[:2000])


def compile_ws(causal, stages, d=128, block_n=128, regs=(232, 40), overlap=False):
    B, H, S = 1, 2, 256
    q = torch.empty(B, H, S, d, dtype=torch.bfloat16)
    k, v, o = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(B, H, S)
    qd, kd, vd, od = G.descriptors(q, k, v, o, 64, block_n)
    fn = G.gluon_attn_ws
    args = (qd, kd, vd, od, lse, H, 1, S, S, 0.1)
    kwargs = dict(CAUSAL=causal, STAGES=stages, S_INSTR_N=block_n, O_INSTR_N=d, CONSUMER_REGS=regs[0],
                  PRODUCER_REGS=regs[1], OVERLAP=overlap, num_warps=4)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src, tempfile.TemporaryDirectory() as out:
        src.write(compiled.asm["ptx"]); src.flush()
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src.name, "-o", f"{out}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", log).group(1)
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    nreg = compiled.asm["ptx"].count("setmaxnreg")
    print(f"WS overlap={overlap} causal={causal} stages={stages} d={d} bn={block_n} regs={regs}: ptxas {used}, spills {spilled}, "
          f"shared {compiled.metadata.shared}, warps {compiled.metadata.num_warps}, setmaxnreg {nreg}", flush=True)


if __name__ == "__main__" and "ws" in sys.argv:
    for kw in [dict(causal=False, stages=2), dict(causal=False, stages=3, overlap=True),
               dict(causal=True, stages=3, overlap=True), dict(causal=False, stages=3, overlap=True, regs=(240, 24)),
               dict(causal=False, stages=2, overlap=True)]:
        try:
            compile_ws(**kw)
        except Exception as e:
            print(kw, "FAILED", type(e).__name__, str(e)[:3000])
if __name__ == "__main__" and "ws4" in sys.argv:
    compile_ws(False, 4, block_n=64, overlap=True)
