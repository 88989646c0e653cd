"""`kpt_triton.aot`: one kernel compiled for an AMD target and two NVIDIA ones (Hopper, Blackwell), and
the report's table and verdict (spills the arch's tuning lists pass, others fail, as do compile
failures and shared memory over the limit)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kpt_triton import aot

# compiled in a fresh process (these tests run under the interpreter, which replaces the compiler),
# one process for both targets: most of its time is importing torch and Triton
COMPILE_ONE = """
import sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from kpt_triton import activations, aot
for arch in sys.argv[1:]:
    with aot._recording(aot.TARGETS[arch]) as launches, FakeTensorMode():
        activations.silu_fwd(torch.empty(8, 256, dtype=torch.bfloat16))
    (launch,) = launches
    r = aot.compile_one(launch, arch)
    print(arch, r.kernel, r.registers, r.spills, r.shared, r.occupancy, r.pressure, sep="|")
"""


def test_one_kernel_compiles_for_an_amd_and_the_nvidia_targets():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_ONE, "gfx942", "sm90", "sm100"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split("|") for line in done.stdout.strip().splitlines()]
    assert [line[0] for line in lines] == ["gfx942", "sm90", "sm100"]
    for arch, kernel, registers, spills, shared, occupancy, pressure in lines:
        assert kernel == "_act_fwd_kernel" and spills == "0"
        assert 0 < int(pressure) <= 256 and 0 <= int(shared) <= aot.TARGETS[arch].shared_limit
        if arch == "gfx942":  # VGPRs + AGPRs / SGPRs, and the compiler's occupancy
            assert registers.startswith(f"{pressure}v+0a/") and occupancy.endswith("waves/SIMD")
        else:  # registers per thread from ptxas, resident warps from registers and shared memory
            assert registers == pressure and occupancy.endswith("warps/SM")


class Vendor:
    name = "acme"
    spills = {"gfx942": {"_listed_kernel": "measured: the tile needs it"}}


def _compiled(kernel: str, spills: int = 0, shared: int = 1024) -> aot.Compiled:
    return aot.Compiled(kernel, "*bf16,i32 BLOCK=64 w4", "96v+0a/20s", spills, shared, "4 waves/SIMD", 96)


def test_a_listed_spill_passes_and_the_table_shows_it(capsys):
    assert aot._report(Vendor(), "gfx942", [_compiled("_listed_kernel", spills=12), _compiled("_clean")]) == 0
    out = capsys.readouterr()
    assert "# acme gfx942: 2 specializations of 2 Triton kernels compiled, 0 failed" in out.out
    assert "## _listed_kernel\n| specialization | registers | spills | shared bytes | occupancy |" in out.out
    assert "| *bf16,i32 BLOCK=64 w4 | 96v+0a/20s | 12 | 1024 | 4 waves/SIMD |" in out.out
    assert "1 with spills (_listed_kernel: measured: the tile needs it)" in out.out
    assert "worst register pressure 96v+0a/20s" in out.out and out.err == ""


def test_unlisted_spills_shared_memory_over_the_limit_and_failures_fail(capsys):
    results = [_compiled("_clean", spills=3), _compiled("_big", shared=65537), "_broken: CompilationError: x"]
    assert aot._report(Vendor(), "gfx942", results) == 3
    err = capsys.readouterr().err
    assert "FAIL _clean [*bf16,i32 BLOCK=64 w4]: 3 spills, not accepted for gfx942" in err
    assert "FAIL _big [*bf16,i32 BLOCK=64 w4]: 65537 bytes of shared memory, over gfx942's 65536" in err
    assert "FAIL _broken: CompilationError: x" in err
    # a spill listed for another arch is not accepted on this one
    assert aot._report(Vendor(), "gfx950", [_compiled("_listed_kernel", spills=1)]) == 1


@pytest.mark.parametrize("problems, code", [(0, 0), (3, 1)])
def test_the_exit_code_is_nonzero_on_any_problem(monkeypatch, problems, code):
    called = []
    monkeypatch.setattr(aot, "check", lambda *a: called.append(a) or problems)
    assert aot.main(["--backend", "rocm", "--arch", "gfx942"]) == code
    assert aot.main(["--backend", "rocm", "--arch", "gfx942", "--dtypes", "float32,bfloat16"]) == code
    assert called == [("rocm", "gfx942", 2, False, (torch.float32, torch.float16, torch.bfloat16)),
                      ("rocm", "gfx942", 2, False, (torch.float32, torch.bfloat16))]


def test_an_unknown_dtype_is_refused():
    with pytest.raises(SystemExit):
        aot.main(["--backend", "rocm", "--arch", "gfx942", "--dtypes", "float32,half"])


def test_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(aot.triton.knobs.runtime, "interpret", True)
    with pytest.raises(SystemExit, match="unset TRITON_INTERPRET"):
        aot.check("rocm", "gfx942", 1)


def test_the_ptxas_report_triton_prints_is_kept_in_the_metadata_and_read():
    report = ("ptxas info    : Function properties for k\n    0 bytes stack frame, 24 bytes spill stores, "
              "16 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers\n")
    stages = {"ptx": None, "cubin": lambda src, metadata: print(report) or b"cubin"}
    aot._keep_ptxas_report(None, stages, None, None, 90)
    metadata = {}
    assert stages["cubin"]("ptx", metadata) == b"cubin"
    assert aot._resources(metadata["ptxas_report"]) == (255, 40)
    with pytest.raises(RuntimeError, match="no register count"):
        aot._resources("ptxas info    : 0 bytes gmem\n")
    key, digest = aot._keep_ptxas_report()  # Triton 3.9 first asks for the hook's cache key
    assert key and len(digest) == 64
