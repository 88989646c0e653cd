"""Compile every kernel for a GPU target ahead of time, on any machine (no GPU needed).

    python -m kpt_triton.aot --backend rocm --arch gfx942

For each kernel of the contract and each conformance case (every dtype) and docs/performance.md shape
(bfloat16), the backend's bodies run with the tuning table of ``--arch`` on fake tensors (shapes,
no data) while every Triton launch is recorded instead of run. Each distinct specialization
(kernel, argument types and alignments, constexprs, compiler options) is then compiled for the
arch's `Target` by Triton's own compiler, and its resources are read from the compiled code:
registers (VGPR/SGPR per lane on AMD, registers per thread on NVIDIA), spills, shared memory /
LDS, and occupancy (AMD: waves per SIMD as the compiler reports it; NVIDIA: resident warps per
SM from registers and shared memory). It prints a table per kernel and exits non-zero on a
compile failure, on shared memory over the arch's limit, or on a spill that the backend does not
accept for that arch (`TritonBackend.spills`, with its reason).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import kpt

from . import attention_tiles, tiling
from .backend import TritonBackend


@dataclass(frozen=True)
class Target:
    """A GPU architecture to compile for: Triton's target, the shared memory (LDS) one block may
    use, the multiprocessors (compute units) of its largest part (persistent grids size some
    constexprs from it), and for NVIDIA the registers and shared memory per SM."""

    gpu: GPUTarget
    shared_limit: int
    units: int
    sm_registers: int = 65536
    sm_shared: int = 0


_SM90 = Target(GPUTarget("cuda", 90, 32), 232448, 132, sm_shared=233472)

TARGETS: dict[str, Target] = {
    "gfx90a": Target(GPUTarget("hip", "gfx90a", 64), 65536, 110),  # MI250X (one die)
    "gfx942": Target(GPUTarget("hip", "gfx942", 64), 65536, 304),  # MI300X
    "gfx950": Target(GPUTarget("hip", "gfx950", 64), 163840, 256),  # MI355X
    "gfx1100": Target(GPUTarget("hip", "gfx1100", 32), 65536, 96),  # RX 7900 XTX
    "gfx1201": Target(GPUTarget("hip", "gfx1201", 32), 65536, 64),  # RX 9070 XT
    "sm80": Target(GPUTarget("cuda", 80, 32), 166912, 108, sm_shared=167936),  # A100
    "sm90": _SM90,  # H100 SXM
    "sm90-hbm3e": _SM90,  # H200 SXM: the same multiprocessors
    "sm100": Target(GPUTarget("cuda", 100, 32), 232448, 148, sm_shared=233472),  # B200
}
"""By the arch tags of the backends' tuning tables."""


class _Pointer:
    """A tensor argument as Triton's specialization sees it: a dtype and an address whose
    alignment is that of the tensor's offset into its storage."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._address = (1 << 20) + int(t.storage_offset()) * t.element_size()

    def data_ptr(self) -> int:
        return self._address


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel (by module and name, so that compiler processes can look
    it up) and its arguments (tensors as `_Pointer`)."""

    module: str
    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def fn(self) -> JITFunction:
        kernel = getattr(importlib.import_module(self.module), self.name)
        return kernel if isinstance(kernel, JITFunction) else kernel.fn  # a `cached_launch` wraps one


@contextlib.contextmanager
def _recording(target: Target) -> Iterator[list[Launch]]:
    """Record Triton launches instead of running them, on ``target``'s multiprocessors and shared memory."""
    launches: list[Launch] = []
    run, count, shared = JITFunction.run, tiling.multiprocessor_count, attention_tiles.shared_memory

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        wrap = [_Pointer(a) if isinstance(a, torch.Tensor) else a for a in args]
        kw = {k: _Pointer(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        launches.append(Launch(self.fn.__module__, self.fn.__name__, tuple(wrap), tuple(kw.items())))

    JITFunction.run = record
    # the cached device queries replaced by the target's numbers (setattr: not their cached type)
    setattr(tiling, "multiprocessor_count", lambda device: target.units)  # noqa: B010
    setattr(attention_tiles, "shared_memory", lambda device: target.shared_limit)  # noqa: B010
    try:
        yield launches
    finally:
        JITFunction.run, tiling.multiprocessor_count, attention_tiles.shared_memory = run, count, shared


def _inputs(mode: FakeTensorMode, case: kpt.Case, dtype: torch.dtype) -> dict[str, Any]:
    """A case's inputs as fake tensors; drawn for real first where making them reads data."""
    g = torch.Generator().manual_seed(0)
    try:
        with mode:
            return case.make(g, dtype)
    except torch._subclasses.fake_tensor.DynamicOutputShapeException:
        real = case.make(g, dtype)
        return {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in real.items()}


def record_launches(backend: TritonBackend, target: Target, perf_only: bool = False,
                    dtypes: tuple[torch.dtype, ...] = kpt.FLOAT_DTYPES) -> list[Launch]:
    """Every launch of every kernel, forward and backward, over the conformance cases (in each of
    ``dtypes`` a case takes; not with ``perf_only``) and the device-only ones: the
    docs/performance.md shapes and the other large cases (bfloat16), with ``backend``'s tuning."""
    kernels = backend.kernels()
    functions = kpt.ops.eager_functions(kernels)
    mode = FakeTensorMode()
    with _recording(target) as launches:
        for spec in kpt.SPECS.values():
            for case in spec.cases():
                if perf_only and not case.device_only:
                    continue
                for dtype in (torch.bfloat16,) if case.device_only else [
                        d for d in case.dtypes or kpt.FLOAT_DTYPES if d in dtypes]:
                    args = _inputs(mode, case, dtype)
                    with mode, contextlib.suppress(DataDependentOutputException):
                        # a body that reads device values on the host (`kpt_triton.products`'
                        # loop of torch.mm over the experts) launches no Triton kernel
                        _run(spec, kernels[spec.name], functions.get(spec.name), args, case.grad)
    return launches


def _run(spec: kpt.KernelSpec, kernel: kpt.Kernel, function: Any, args: dict[str, Any], grad: bool) -> None:
    """The forward, and the backward where the case has one, as the backend's calls run them."""
    checked = spec.check((), args, kpt.FLOAT_DTYPES)
    if function is None or not grad:
        kernel.forward(*spec.forward_values(checked, False))
        return
    leaves = {k: v.detach().requires_grad_() if k in spec.differentiable and isinstance(v, torch.Tensor) else v
              for k, v in checked.items()}
    outs = [o for o in function(*spec.forward_values(leaves, True))[: len(spec.outputs)]
            if o.requires_grad]
    inputs = [v for k, v in leaves.items() if k in spec.differentiable and isinstance(v, torch.Tensor)]
    if outs and inputs:
        torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], allow_unused=True)


@dataclass(frozen=True)
class Compiled:
    """The resources of one compiled specialization."""

    kernel: str
    specialization: str
    registers: str
    spills: int
    shared: int
    occupancy: str
    pressure: int
    """Registers per lane or thread (AMD: VGPRs + AGPRs), for the worst case of a target."""


def _specialization(launch: Launch, target: Target) -> tuple[Any, ...]:
    """``(signature, constexprs, attrs, options)`` as Triton derives them for ``target``."""
    backend = make_backend(target.gpu)
    kwargs = dict(launch.kwargs)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return launch.fn._pack_args(backend, kwargs, bound, specialization, options)


_HOOK_KEY = "kpt_triton.aot: ptxas report kept in the metadata"


def _keep_ptxas_report(backend: Any = None, stages: dict[str, Any] | None = None, options: Any = None,
                       language: Any = None, capability: Any = None) -> tuple[str, str] | None:
    """Triton's compile-stage hook: the report of Triton's own ``ptxas -v`` (printed where
    ``knobs.nvidia.dump_ptxas_log`` is set) kept in the kernel's metadata as ``ptxas_report``, cached
    with the kernel, so that reading registers and spills takes no second ptxas run. Called with no
    arguments (Triton 3.9 does so first), it returns its part of the cache key and that part's hash."""
    if stages is None:
        return _HOOK_KEY, hashlib.sha256(_HOOK_KEY.encode()).hexdigest()
    if "cubin" not in stages:
        return None
    cubin = stages["cubin"]

    def reported(src: str, metadata: dict[str, Any]) -> bytes:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            binary = cubin(src, metadata)
        metadata["ptxas_report"] = printed.getvalue()
        return binary

    stages["cubin"] = reported
    return None


def compile_one(launch: Launch, arch: str) -> Compiled:
    target = TARGETS[arch]
    options, signature, constexprs, attrs = _specialization(launch, target)
    knobs = triton.knobs
    with knobs.runtime.scope(), knobs.nvidia.scope():
        knobs.runtime.add_stages_inspection_hook = _keep_ptxas_report
        knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target.gpu,
                                  options=options.__dict__)
    name = launch.name
    names = launch.fn.arg_names
    shown = ",".join(f"{names[k[0]]}={v}" for k, v in constexprs.items()
                     if len(k) == 1 and names[k[0]].isupper() and v is not None)
    spec = f"{','.join(t for t in signature.values() if t != 'constexpr')} {shown} w{options.num_warps}"
    shared = compiled.metadata.shared
    if target.gpu.backend == "hip":
        meta = dict(re.findall(r"^\s+\.(\w+):\s+(\S+)$", compiled.asm["amdgcn"], re.M))
        vgpr, agpr, sgpr = int(meta["vgpr_count"]), int(meta.get("agpr_count", 0)), int(meta["sgpr_count"])
        occupancy = re.search(r"; Occupancy: (\d+)", compiled.asm["amdgcn"])
        return Compiled(name, spec, f"{vgpr}v+{agpr}a/{sgpr}s",
                        int(meta["vgpr_spill_count"]) + int(meta["sgpr_spill_count"]), shared,
                        f"{occupancy.group(1)} waves/SIMD" if occupancy else "?", vgpr + agpr)
    # a kernel that Triton compiled and cached outside this check has no report: ptxas runs again
    report = getattr(compiled.metadata, "ptxas_report", None) or _ptxas(compiled.asm["ptx"], target)
    regs, spills = _resources(report)
    threads = options.num_warps * 32
    blocks = min(target.sm_registers // (-(-regs // 8) * 8 * threads), target.sm_shared // max(shared, 1), 32)
    return Compiled(name, spec, str(regs), spills, shared, f"{min(blocks * options.num_warps, 64)} warps/SM", regs)


def _ptxas(ptx: str, target: Target) -> str:
    """ptxas's report (``-v``) on the kernel's PTX."""
    arch = target.gpu.arch
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src, tempfile.TemporaryDirectory() as out:
        src.write(ptx)
        src.flush()
        # the ptxas Triton itself uses for this arch (Triton 3.9 compiles sm90 with its newer one)
        ptxas = get_ptxas(arch).path
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}",
                              src.name, "-o", f"{out}/k.cubin"], capture_output=True, text=True, check=True).stderr
    return log


def _resources(log: str) -> tuple[int, int]:
    """Registers per thread and spilled bytes, from a ptxas report."""
    used = re.search(r"Used (\d+) registers", log)
    if used is None:
        raise RuntimeError(f"ptxas -v reported no register count for the kernel:\n{log}")
    regs = int(used.group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills


def _compile_or_error(args: tuple[Launch, str]) -> Compiled | str:
    try:
        return compile_one(*args)
    except Exception as e:  # reported, and the run fails, after every other kernel compiled
        return f"{args[0].name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def check(backend_name: str, arch: str, jobs: int, perf_only: bool = False,
          dtypes: tuple[torch.dtype, ...] = kpt.FLOAT_DTYPES) -> int:
    """Compile, print the table, and return the number of problems."""
    if triton.knobs.runtime.interpret:
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    found = kpt.reload_backends().find(backend_name)
    if not isinstance(found, TritonBackend):
        raise SystemExit(f"{backend_name!r} is not an installed backend built on kpt-triton")
    if arch not in found.tables or arch not in TARGETS:
        raise SystemExit(f"{backend_name} has no arch {arch!r}; compilable: "
                         f"{', '.join(a for a in found.tables if a in TARGETS)}")
    backend = type(found)(arch=arch)
    # one compile per kernel, argument types, constexprs and options: launches that differ only
    # in the alignment or value-1 specialization of their arguments compile to the same tiles
    unique: dict[tuple[Any, ...], Launch] = {}
    for launch in record_launches(backend, TARGETS[arch], perf_only, dtypes):
        options, signature, constexprs, _ = _specialization(launch, TARGETS[arch])
        key = (launch.module, launch.name, str(signature), str(constexprs), str(sorted(options.__dict__.items())))
        unique.setdefault(key, launch)
    with ProcessPoolExecutor(jobs) as pool:
        results = list(pool.map(_compile_or_error, [(launch, arch) for launch in unique.values()], chunksize=4))
    return _report(backend, arch, results)


def _report(backend: TritonBackend, arch: str, results: list[Compiled | str]) -> int:
    target, accepted = TARGETS[arch], backend.spills.get(arch, {})
    problems = [r for r in results if isinstance(r, str)]
    done = sorted((r for r in results if isinstance(r, Compiled)), key=lambda r: (r.kernel, r.specialization))
    print(f"# {backend.name} {arch}: {len(done)} specializations of "
          f"{len({r.kernel for r in done})} Triton kernels compiled, {len(problems)} failed")
    for kernel in sorted({r.kernel for r in done}):
        rows = [r for r in done if r.kernel == kernel]
        print(f"\n## {kernel}\n| specialization | registers | spills | shared bytes | occupancy |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r.specialization} | {r.registers} | {r.spills} | {r.shared} | {r.occupancy} |")
            if r.shared > target.shared_limit:
                problems.append(f"{kernel} [{r.specialization}]: {r.shared} bytes of shared memory, "
                                f"over {arch}'s {target.shared_limit}")
            if r.spills and kernel not in accepted:
                problems.append(f"{kernel} [{r.specialization}]: {r.spills} spills, not accepted for {arch}")
    worst = max(done, key=lambda r: r.pressure, default=None)
    print(f"\n# totals {arch}: {len(done)} compiled, {sum(r.spills > 0 for r in done)} with spills "
          f"({', '.join(f'{k}: {v}' for k, v in accepted.items()) or 'none accepted'}), worst register "
          f"pressure {worst.registers if worst else '-'} ({worst.kernel if worst else '-'}), "
          f"max shared {max((r.shared for r in done), default=0)} of {target.shared_limit}")
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return len(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpt_triton.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="an installed backend built on kpt-triton (cuda, rocm)")
    parser.add_argument("--arch", required=True, help="an arch tag of its tuning tables (gfx942, sm90, ...)")
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes")
    parser.add_argument("--perf-shapes", action="store_true",
                        help="only the docs/performance.md shapes (bfloat16), not every conformance case")
    named = {str(d).removeprefix("torch."): d for d in kpt.FLOAT_DTYPES}
    parser.add_argument("--dtypes", default=",".join(named),
                        help="the conformance cases' dtypes to compile (default: every one)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.dtypes.split(",") if name not in named]
    if unknown:
        parser.error(f"--dtypes: {', '.join(unknown)} not among {', '.join(named)}")
    dtypes = tuple(named[name] for name in args.dtypes.split(","))
    return 1 if check(args.backend, args.arch, args.jobs, args.perf_shapes, dtypes) else 0


if __name__ == "__main__":
    sys.exit(main())
