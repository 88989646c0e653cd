"""The launchers' plain-Python size helpers agree with Triton's own; the norm forwards of narrow
rows are compiled without fused multiply-adds (`kpt_triton.tiling.row_statistics_options`)."""

from __future__ import annotations

import os
import subprocess
import sys

import triton

from kpt_triton.tiling import cdiv, next_pow2


def test_cdiv_matches_triton() -> None:
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_pow2_matches_triton() -> None:
    for n in [*range(1, 600), 4097, 65535, 65536, 128256, 2**31 - 1]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    # where Triton's gives 0, a block size of 1 is returned: a block never has size 0
    assert next_pow2(0) == 1


# compiled for sm90 in a fresh process (these tests run under the interpreter), the SASS read with
# the cuobjdump that Triton ships: which norm forwards keep multiply-add fusion
FUSED_MULTIPLY_ADDS = """
import os, subprocess, sys, tempfile, torch, triton
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.compiler import ASTSource
from kpt_triton import aot, layer_norm, rms_norm
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for name, width in (("layer_norm", 17), ("rms_norm", 17), ("layer_norm", 4096), ("rms_norm", 4096)):
    with aot._recording(132) as launches, FakeTensorMode():
        x, w = torch.empty(3, width, dtype=torch.bfloat16), torch.empty(width, dtype=torch.bfloat16)
        if name == "layer_norm":
            layer_norm.layer_norm_fwd(x, w, w, 1e-5)
        else:
            rms_norm.rms_norm_fwd(x, w, 1e-6)
    (launch,) = launches
    options, signature, constexprs, attrs = aot._specialization(launch, aot.TARGETS["sm90"])
    compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=aot.TARGETS["sm90"].gpu,
                              options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"]); f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    print(name, width, sass.count("FFMA"), sep="|")
"""


def test_norm_forwards_of_narrow_rows_compile_without_fused_multiply_adds():
    # one element of a row per lane: lanes must round Σx² alike (`tiling.row_statistics_options`)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", FUSED_MULTIPLY_ADDS], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = {(name, int(width)): int(n) for name, width, n in (line.split("|") for line in done.stdout.split())}
    assert counts[("layer_norm", 17)] == counts[("rms_norm", 17)] == 0, counts
    assert counts[("layer_norm", 4096)] > 0 and counts[("rms_norm", 4096)] > 0, counts  # fusion stays on there
