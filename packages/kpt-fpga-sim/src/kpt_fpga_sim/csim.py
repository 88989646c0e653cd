"""C-simulation check: the simulator's fixed-point kernels written as HLS C++ and run natively.

For kernels built from +, ×, comparisons, shifts and table lookups this module emits the C++ an
HLS designer would write (``ap_fixed`` types, loop nests with their pragmas), compiles it with
g++ against the ``ap_types`` headers of Vitis HLS (Apache-2.0; shipped in the hls4ml wheel under
``hls4ml/templates/vivado/ap_types/``) and returns what it prints. The tests compare that, bit for
bit, with the simulator.

The headers are never vendored: `ap_types_dir` downloads the wheel once with pip (no install, and
only a wheel: an sdist's build code would run before any check), refuses it unless its sha256 is
the pinned `WHEEL_SHA256`, unpacks only that directory into a cache (``$KPT_FPGA_SIM_CACHE`` or
``~/.cache/kpt-fpga-sim``, a directory of this user that no one else may write: `kpt.cache`),
refusing any member whose path leaves it, and reuses it afterwards, each time only if its files
still have the pinned digest `AP_TYPES_SHA256`. Offline, put the wheel (or the unpacked
directory) in the cache yourself: the error says where. g++, the compiled program and pip each
run under a timeout.

Programs emitted here (each prints one value per line, exactly, as ``%.17g`` of a double):

* `quantize_source`: ``fmt v = x`` for doubles x and several formats (every mode);
* `linear_source`: ``y = act(x · wᵀ + b)`` with a full-width accumulator, act None or relu;
* `silu_source`: ``y = x · σ(x)`` with the sigmoid unit's interpolated table;
* `rms_norm_source`: ``rms_norm`` given the simulator's rsqrt per row (mantissa and exponent);
  it prints the rsqrt argument of every row (as the raw integer of its C++ type), then y.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from torch import Tensor

from kpt import cache

from .fixed import bits_for
from .formats import ApFixed
from .nonlinear import Table

HLS4ML_VERSION = "1.3.0"
WHEEL = f"hls4ml-{HLS4ML_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "01bf1de2cd9bca56699b9fe3385cb1735026b022f9580fe1d73faf192dfb90f2"
"""The sha256 of the wheel on PyPI; any other file is refused."""
AP_TYPES_SHA256 = "bba1ec9129ca03d698f2772a7c769d4b946ac930fefe6098e2f75928da4ee5ce"
"""`tree_digest` of the wheel's ap_types directory: a cached or pre-filled header directory is used
only if it has this digest."""
_WHEEL_DIR = "hls4ml/templates/vivado/ap_types/"
COMPILE_TIMEOUT_S = 600
"""How long g++ may take for one program (10 to 30 s is usual on one core)."""
RUN_TIMEOUT_S = 120
"""How long a compiled program may run (it prints its values at once)."""


class CsimUnavailable(RuntimeError):
    """No C++ compiler, or the ap_types headers could not be fetched (no network)."""


class CsimIntegrityError(RuntimeError):
    """The downloaded wheel is not the pinned one, or it holds a path that leaves its directory."""


def cache_root() -> Path:
    """The cache (`kpt.cache.user_dir`); `PermissionError` for a ``$KPT_FPGA_SIM_CACHE`` that others
    could write to."""
    return cache.user_dir("KPT_FPGA_SIM_CACHE", "kpt-fpga-sim")


def cache_dir() -> Path:
    return cache_root() / f"ap_types-hls4ml-{HLS4ML_VERSION}"


_OFFLINE = (f"to work offline, put {WHEEL} (sha256 {WHEEL_SHA256}) in $KPT_FPGA_SIM_CACHE "
            "(default ~/.cache/kpt-fpga-sim), or its hls4ml/templates/vivado/ap_types/ directory "
            f"as $KPT_FPGA_SIM_CACHE/ap_types-hls4ml-{HLS4ML_VERSION}/")


def check_wheel(path: Path) -> None:
    """Refuse any file but the pinned wheel."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise CsimIntegrityError(f"{path.name}: sha256 {digest}, expected {WHEEL_SHA256}; refusing it")


def tree_digest(root: Path) -> str:
    """The sha256 of a directory tree: each file's path (relative, POSIX) and content, in path
    order. Refuses anything but directories and regular files (a link could change after the check)."""
    entries = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                entries[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif not stat.S_ISDIR(mode):
                raise CsimIntegrityError(f"{path} is not a regular file; refusing the headers in {root}")
    return hashlib.sha256("".join(f"{p}\0{d}\n" for p, d in sorted(entries.items())).encode()).hexdigest()


def check_headers(root: Path) -> None:
    """Refuse a header directory whose files are not the pinned ones (`AP_TYPES_SHA256`)."""
    digest = tree_digest(root)
    if digest != AP_TYPES_SHA256:
        raise CsimIntegrityError(f"{root}: its files have digest {digest}, expected {AP_TYPES_SHA256}; refusing "
                                 "them (delete the directory to have it unpacked again from the pinned wheel)")


def unpack_ap_types(wheel: Path, target: Path) -> None:
    """Unpack the wheel's ap_types directory into ``target``, refusing members whose path is
    absolute or leaves the directory (``..``)."""
    root = target.resolve()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.startswith(_WHEEL_DIR) or name.endswith("/"):
                continue
            rel = PurePosixPath(name[len(_WHEEL_DIR):])
            out = (root / rel).resolve()
            if rel.is_absolute() or ".." in rel.parts or "\\" in name or root not in out.parents:
                raise CsimIntegrityError(f"{wheel.name}: member {name!r} leaves {_WHEEL_DIR}; refusing the archive")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(archive.read(name))


def _download(tmp: str) -> Path:
    cached = cache_root() / WHEEL
    if cached.exists():
        return cached
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", f"hls4ml=={HLS4ML_VERSION}", "-d", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        raise CsimUnavailable(f"'{' '.join(cmd)}' timed out; {_OFFLINE}") from exc
    wheel = Path(tmp) / WHEEL
    if done.returncode or not wheel.exists():
        why = done.stderr.strip()[-400:]
        raise CsimUnavailable(f"could not download hls4ml=={HLS4ML_VERSION}: {why}\n{_OFFLINE}")
    return wheel


def ap_types_dir() -> Path:
    """The unpacked ``ap_types`` headers: from the cache, else from the pinned hls4ml wheel (in
    the cache, or downloaded with pip), checked and unpacked the first time; either way checked
    against `AP_TYPES_SHA256` (`CsimIntegrityError`)."""
    target = cache_dir()
    if not os.path.lexists(target):
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _download(tmp)
            check_wheel(wheel)
            staging = Path(tmp) / "ap_types"
            staging.mkdir()
            unpack_ap_types(wheel, staging)
            partial = Path(tempfile.mkdtemp(dir=target.parent)) / "ap_types"  # fresh, beside the target
            shutil.copytree(staging, partial)
            try:
                partial.rename(target)
            except OSError:  # another process unpacked it first
                pass
            shutil.rmtree(partial.parent, ignore_errors=True)
    problem = cache.unsafe(target)
    if problem:
        raise CsimIntegrityError(f"{target} {problem}; refusing the headers in it")
    check_headers(target)
    return target


def compiler() -> str:
    found = shutil.which(os.environ.get("CXX", "g++"))
    if found is None:
        raise CsimUnavailable("no C++ compiler (g++) on PATH")
    return found


def run(source: str) -> list[float]:
    """Compile ``source`` against the ap_types headers, run it, parse the numbers it prints."""
    include = ap_types_dir()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "kernel.cpp", Path(tmp) / "kernel"
        src.write_text(source)
        cmd = [compiler(), "-std=c++17", "-O1", "-w", "-I", str(include), str(src), "-o", str(exe)]
        build = _run(cmd, COMPILE_TIMEOUT_S)
        if build.returncode:
            raise RuntimeError(f"g++ failed:\n{build.stderr[-3000:]}")
        out = _run([str(exe)], RUN_TIMEOUT_S)
        if out.returncode:
            raise RuntimeError(f"the C-simulation program exited with {out.returncode}:\n{out.stderr[-3000:]}")
    return [float(v) for v in out.stdout.split()]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cmd[0]).name} ran past its {timeout:g} s timeout; stopped") from None


# -- emitters ---------------------------------------------------------------------------------

_PRELUDE = """#include <ap_fixed.h>
#include <cstdio>

template <typename T> void emit(const T &v) { std::printf("%.17g\\n", v.to_double()); }
"""


def _doubles(t: Tensor) -> str:
    return "{" + ", ".join(repr(float(v)) for v in t.reshape(-1).tolist()) + "}"


def _acc_type(fmt: ApFixed, k: int) -> str:
    extra = bits_for(k)
    return f"ap_fixed<{2 * fmt.w + extra}, {2 * fmt.i + extra}>"


def quantize_source(formats: Sequence[ApFixed], values: Tensor) -> str:
    """``fmt v = x`` for every format, then every value (format-major)."""
    loops = "".join(f"""
  for (int i = 0; i < {values.numel()}; i++) {{
    {fmt.cpp()} v = IN[i];
    emit(v);
  }}""" for fmt in formats)
    return _PRELUDE + f"""
static const double IN[{max(values.numel(), 1)}] = {_doubles(values)};

int main() {{{loops}
}}
"""


def linear_source(fmt: ApFixed, x: Tensor, w: Tensor, b: Tensor | None, activation: str | None) -> str:
    (m, k), n = x.shape, w.shape[0]
    bias = f"static const double B[{n}] = {_doubles(b)};" if b is not None else ""
    pre = "acc + data_t(B[j])" if b is not None else "acc"
    act = "pre > 0 ? pre : data_t(0)" if activation == "relu" else "pre"
    return _PRELUDE + f"""
typedef {fmt.cpp()} data_t;
typedef {_acc_type(fmt, k)} acc_t;   // full width: no product or partial sum is ever rounded
static const double X[{m}][{k}] = {_doubles(x)};
static const double W[{n}][{k}] = {_doubles(w)};
{bias}

void linear(const data_t x[{m}][{k}], const data_t w[{n}][{k}], data_t y[{m}][{n}]) {{
rows:
  for (int i = 0; i < {m}; i++) {{
  cols:
    for (int j = 0; j < {n}; j++) {{
      acc_t acc = 0;
    dot:
      for (int kk = 0; kk < {k}; kk++) {{
#pragma HLS PIPELINE II=1
        acc += x[i][kk] * w[j][kk];
      }}
      data_t pre = {pre};
      y[i][j] = {act};
    }}
  }}
}}

int main() {{
  static data_t x[{m}][{k}], w[{n}][{k}], y[{m}][{n}];
  for (int i = 0; i < {m}; i++) for (int kk = 0; kk < {k}; kk++) x[i][kk] = X[i][kk];
  for (int j = 0; j < {n}; j++) for (int kk = 0; kk < {k}; kk++) w[j][kk] = W[j][kk];
  linear(x, w, y);
  for (int i = 0; i < {m}; i++) for (int j = 0; j < {n}; j++) emit(y[i][j]);
}}
"""


def _table_source(table: Table, prefix: str) -> str:
    """The ROM and the interpolating unit of ``table`` as ``{prefix}_unit(x)``."""
    c0, c1 = table.coefficients
    fc = table.f_coef
    w0 = int(c0.abs().max()).bit_length() + 1
    w1 = max(int(c1.abs().max()).bit_length(), 1) + 1
    inp, out = table.input_format, table.output_format
    span = table.hi - table.lo
    iu = max(span.bit_length(), 1)
    wu = iu + table.f_in
    tb = table.t_bits
    scale = float(2.0 ** -fc)
    frac = (f"ap_ufixed<{tb}, 0> t; t.range({tb - 1}, 0) = bits.range({tb - 1}, 0);\n  return c0 + c1 * t;"
            if tb > 0 else "return c0;")
    return f"""
typedef ap_fixed<{w0}, {w0 - fc}> {prefix}_c0_t;
typedef ap_fixed<{w1}, {w1 - fc}> {prefix}_c1_t;
static const {prefix}_c0_t {prefix.upper()}_C0[{table.entries}] = {_doubles(c0.double() * scale)};
static const {prefix}_c1_t {prefix.upper()}_C1[{table.entries}] = {_doubles(c1.double() * scale)};

{out.cpp()} {prefix}_unit({inp.cpp()} x) {{
#pragma HLS INLINE
  if (x < {inp.cpp()}({table.lo})) x = {table.lo};
  if (x > {inp.cpp()}({table.hi})) x = {table.hi};
  ap_ufixed<{wu}, {iu}> u = x - {inp.cpp()}({table.lo});
  ap_uint<{wu}> bits = u.range({wu - 1}, 0);
  ap_uint<{wu}> k = bits >> {tb};
  {prefix}_c0_t c0 = {prefix.upper()}_C0[k];
  {prefix}_c1_t c1 = {prefix.upper()}_C1[k];
  {frac}
}}
"""


def silu_source(fmt: ApFixed, x: Tensor, sigmoid: Table) -> str:
    n = x.numel()
    return _PRELUDE + f"""
typedef {fmt.cpp()} data_t;
{_table_source(sigmoid, "sigmoid")}
static const double X[{n}] = {_doubles(x)};

int main() {{
  for (int i = 0; i < {n}; i++) {{
#pragma HLS PIPELINE II=1
    data_t x = X[i];
    data_t y = x * sigmoid_unit(x);
    emit(y);
  }}
}}
"""


def rms_norm_source(fmt: ApFixed, x: Tensor, w: Tensor, inv_d: tuple[int, int, int],
                    eps: tuple[int, int, int], mantissa: Tensor, exponent: Tensor, mantissa_bits: int) -> str:
    """``inv_d`` / ``eps``: the simulator's constants as (raw, W, I); ``mantissa``/``exponent``:
    the simulator's rsqrt per row as ``m · 2^(e − mantissa_bits + 2)`` with ``m`` of W = mantissa_bits."""
    n, d = x.shape
    shift = 96
    return _PRELUDE + f"""
typedef {fmt.cpp()} data_t;
typedef {_acc_type(fmt, d)} acc_t;
typedef ap_fixed<{mantissa_bits}, 2> mant_t;
static const double X[{n}][{d}] = {_doubles(x)};
static const double WEIGHT[{d}] = {_doubles(w)};
static const long long MANT[{n}] = {{{", ".join(str(v) for v in mantissa.tolist())}}};
static const int EXPONENT[{n}] = {{{", ".join(str(v) for v in exponent.tolist())}}};

template <typename T> void emit_raw(const T &v) {{
  ap_int<T::width> r;
  r.range() = v.range();
  std::printf("%lld %d %d\\n", r.to_int64(), T::width, T::iwidth);
}}

int main() {{
  ap_fixed<{inv_d[1]}, {inv_d[2]}> inv_d;
  inv_d.range() = {inv_d[0]};
  ap_fixed<{eps[1]}, {eps[2]}> eps;
  eps.range() = {eps[0]};
  for (int r = 0; r < {n}; r++) {{
    data_t x[{d}];
    acc_t sum_sq = 0;
  sum_sq:
    for (int j = 0; j < {d}; j++) {{
#pragma HLS PIPELINE II=1
      x[j] = X[r][j];
      sum_sq += x[j] * x[j];
    }}
    emit_raw(sum_sq * inv_d + eps);           // the rsqrt unit's argument
    mant_t m;
    m.range() = MANT[r];
  scale:
    for (int j = 0; j < {d}; j++) {{
#pragma HLS PIPELINE II=1
      auto p = x[j] * m * data_t(WEIGHT[j]);
      // the normalizing shifter: the exact value p · 2^e, then one assignment to data_t
      ap_fixed<decltype(p)::width + {2 * shift}, decltype(p)::iwidth + {shift}> wide = p;
      wide = EXPONENT[r] >= 0 ? (wide << EXPONENT[r]) : (wide >> -EXPONENT[r]);
      data_t y = wide;
      emit(y);
    }}
  }}
}}
"""
