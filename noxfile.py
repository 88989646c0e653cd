"""Sessions for kpt: unit tests, the conformance suite per backend, its report, lint and benchmarks.

    nox                                     # every session this machine can run
    nox -s main                             # the main job: every backend that can run here, then the report
    nox -s conformance report               # the same at full depth, one virtualenv per profile
    nox -s lint wheels conformance install example aot usage models newest docs  # CI (scripts/ci.sh)
    nox -s vendor -- ../kpt-acme            # a backend package from outside: its path or requirement

Every session installs from constraints/ci.txt, so a CPU machine never downloads CUDA wheels.
Supported versions (README.md): constraints/ci.txt pins the oldest triton kpt supports, 3.6, and the
newest torch, 2.13, so every session but `newest` tests those ends of the ranges, and `newest` the
newest triton (`NEWEST`). The oldest torch, 2.11, has no CPU build on PyPI: `oldest` (`OLDEST`) runs
on a machine with an NVIDIA GPU, on the CPU, and CI cannot run it.
Each conformance session installs kpt-core, the suite (kpt-conformance), one backend package (with
the packages it builds on) and nothing else, and runs `kpt check` on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False

CONSTRAINTS = ("-c", "constraints/ci.txt")
HAS_NVIDIA_GPU = shutil.which("nvidia-smi") is not None
HAS_AMD_GPU = shutil.which("rocminfo") is not None
HAS_INTEL_GPU = shutil.which("xpu-smi") is not None

# without a GPU the Triton kernels run on CPU tensors through Triton's interpreter (which needs numpy)
CUDA_ENV = {} if HAS_NVIDIA_GPU else {"TRITON_INTERPRET": "1"}
CUDA_EXTRA = () if HAS_NVIDIA_GPU else ("numpy",)
# kpt-rocm likewise, with the tuning of the arch that KPT_ROCM_ARCH names (default gfx942)
ROCM_ENV = {} if HAS_AMD_GPU else {"TRITON_INTERPRET": "1"}
ROCM_EXTRA = () if HAS_AMD_GPU else ("numpy",)
# kpt-xpu likewise, with the tuning of the arch that KPT_XPU_ARCH names (default pvc, the Max series)
XPU_ENV = {} if HAS_INTEL_GPU else {"TRITON_INTERPRET": "1"}
XPU_EXTRA = () if HAS_INTEL_GPU else ("numpy",)

# conformance profile -> (backend name, packages to install, other requirements, environment); a
# profile is named as its backend names its configuration (`kpt.Backend.conformance_profile`): the
# report goes to reports/<profile>/ and the expected failures are conformance/xfails/<profile>.txt
CUDA_PROFILE = "cuda" if HAS_NVIDIA_GPU else "cuda-interpret"
ROCM_PROFILE = "rocm" if HAS_AMD_GPU else "rocm-interpret"
XPU_PROFILE = "xpu" if HAS_INTEL_GPU else "xpu-interpret"
PROFILES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], dict[str, str]]] = {
    "reference": ("reference", (), (), {}),
    CUDA_PROFILE: ("cuda", ("kpt-triton", "kpt-cuda"), CUDA_EXTRA, CUDA_ENV),
    ROCM_PROFILE: ("rocm", ("kpt-triton", "kpt-rocm"), ROCM_EXTRA, ROCM_ENV),
    XPU_PROFILE: ("xpu", ("kpt-triton", "kpt-xpu"), XPU_EXTRA, XPU_ENV),
    "fpga-sim": ("fpga-sim", ("kpt-fpga-sim",), (), {}),
    "fpga-sim-fixed": ("fpga-sim", ("kpt-fpga-sim",), (), {"KPT_FPGA_SIM_FORMAT": "ap_fixed<16,6,RND,SAT>"}),
    # kpt-mps's Metal shaders through its emulator (the system C++ compiler) on CPU tensors: a
    # simulator like cuda-interpret, never picked automatically; on a Mac, scripts/mps_check.sh
    "mps-emulate": ("mps", ("kpt-mps",), (), {"KPT_MPS_EMULATE": "1"}),
}
# profiles that CI runs as a representative cut: every contract and bad-input test, and the numerics
# of one dtype: bfloat16 for cuda, rocm and xpu (`newest` adds cuda's float32), and float32 for mps
# (the tightest check of the shaders' math, with the float32-parameter cases of 16-bit activations);
# `nox -s "conformance(profile='rocm-interpret')" -- -k ""` runs the whole suite
BFLOAT16_CUT = ("-k", "bfloat16 or not test_numerics")
CUTS = {"cuda-interpret": BFLOAT16_CUT, "rocm-interpret": BFLOAT16_CUT, "xpu-interpret": BFLOAT16_CUT,
        "mps-emulate": ("-k", "float32 or fp32_ or not test_numerics")}
# torch on one thread: the suite's tensors are small, and torch's default OpenMP threads busy-wait on
# them (the reference's rms_norm, softmax and attention cases: 93 s of CPU with the default two
# threads of a 2-core machine, 20 s with one)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
BASE = ("kpt-core", "kpt-conformance")  # every session's: the contract and the suite
PACKAGES = (*BASE, "kpt-triton", "kpt-cuda", "kpt-rocm", "kpt-xpu", "kpt-fpga-sim", "kpt-mps")
EXAMPLE = "examples/kpt-example"


def _install(session: nox.Session, *packages: str, extra: tuple[str, ...] = (), editable: bool = False) -> None:
    """The `BASE` packages and ``packages`` (names under packages/), with pytest and ``extra``."""
    paths = [f"packages/{p}" for p in (*BASE, *packages)]
    if editable:
        paths = [arg for p in paths for arg in ("-e", p)]
    session.install(*CONSTRAINTS, "pytest", *extra, *paths)


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's unit tests on the CPU (Triton kernels through the interpreter), with the
    optional rich of kpt-core[cli] (its plain fallback is tested by hiding it), on editable installs:
    the quick loop while changing code. CI runs the same tests on the built wheels (`wheels`)."""
    # matplotlib: kpt-core's roofline test draws a recorded benchmark run
    _install(session, *PACKAGES[len(BASE):], extra=("numpy", "matplotlib", "rich"), editable=True)
    # one run per package: their test files share names (test_rms_norm.py in core and in kpt-triton)
    for package in PACKAGES:
        session.run("pytest", "-q", "-p", "no:cacheprovider", f"packages/{package}/tests", *session.posargs,
                    env={"TRITON_INTERPRET": "1"})


DISTRIBUTED_TESTS = "packages/kpt-core/tests/test_distributed.py"


@nox.session(default=False)
def distributed(session: nox.Session) -> None:
    """kpt.distributed on the CPU alone (the `tests` session runs it too): every kernel's DTensor
    sharding rules and the vocabulary-parallel losses against the single-process results, in gloo
    groups of 2 and 4 processes (reference backend)."""
    _install(session, extra=("numpy",))  # torch's DTensor debug tools (counting collectives) import it
    session.run("pytest", "-q", "-p", "no:cacheprovider", DISTRIBUTED_TESTS, *session.posargs)


@nox.session
@nox.parametrize("profile", list(PROFILES))
def conformance(session: nox.Session, profile: str) -> None:
    """The conformance suite for one backend profile (`kpt check`); writes reports/<profile>/.
    Arguments after -- go to pytest (``-x``, ``-k rms_norm``, ``--kpt-kernels rms_norm``)."""
    backend, packages, extra, env = PROFILES[profile]
    _install(session, *packages, extra=extra)
    session.run("kpt", "check", "--backend", backend, "--force", "--report", f"reports/{profile}",
                "--xfails", "conformance/xfails", "--", *CUTS.get(profile, ()), *session.posargs,
                env={**ONE_THREAD, **env})


# the newest releases kpt supports; the rest as constraints/ci.txt pins it (torch: the CPU build of
# 2.13.0, the newest torch the packages declare)
NEWEST = {"triton": "3.9.0", "numpy": "2.4.6"}
# the oldest: torch 2.11 has no CPU build on PyPI; its CUDA build runs these tests on the CPU too
OLDEST = {"torch": "2.11.0", "triton": "3.6.0"}


def _pinned(session: nox.Session, releases: dict[str, str]) -> str:
    """A constraints file in the session's temporary directory: constraints/ci.txt with ``releases``
    (name -> version) pinned over its own pins; returns its path."""
    pins = [line for line in Path("constraints/ci.txt").read_text().splitlines() if line.split("==")[0] not in releases]
    constraints = Path(session.create_tmp()) / "releases.txt"
    constraints.write_text("\n".join([*pins, *(f"{name}=={version}" for name, version in releases.items())]))
    return str(constraints)


def _release_checks(session: nox.Session, releases: dict[str, str], packages: tuple[str, ...], report: str,
                    env: dict[str, str], cuts: dict[str, tuple[str, ...]] | None = None) -> None:
    """``packages``' unit tests (pytest arguments ``cuts`` for some, then the session's) and the cuda
    backend's conformance in float32 through Triton's interpreter, with ``releases`` pinned over
    constraints/ci.txt; report in reports/``report``/."""
    editable = [arg for package in PACKAGES for arg in ("-e", f"packages/{package}")]
    session.install("-c", _pinned(session, releases), "pytest", "numpy", "matplotlib", "rich", *editable)
    env = {"TRITON_INTERPRET": "1", **env}
    for package in packages:
        session.run("pytest", "-q", "-p", "no:cacheprovider", f"packages/{package}/tests",
                    *(cuts or {}).get(package, ()), *session.posargs, env=env)
    session.run("kpt", "check", "--backend", "cuda", "--dtypes", "float32", "--force", "--report", f"reports/{report}",
                "--xfails", "conformance/xfails", env=env)


# newest's representative cut of kpt-triton's unit tests: their float32 and dtype-free cases (523 of
# 1387); `nox -s newest -- -k ""` runs them all under the newest Triton
NEWEST_CUTS = {"kpt-triton": ("-k", "not float16 and not bfloat16")}
# wheels' cut of kpt-triton's unit tests: all but the float16 cases (955 of 1387; float16 takes
# bfloat16's 16-bit tiles and code paths); `nox -s tests` runs them all
WHEELS_CUTS = {"kpt-triton": ("-k", "not float16 or bfloat16")}


@nox.session
def newest(session: nox.Session) -> None:
    """The unit tests of the packages that use Triton (kpt-triton's cut to `NEWEST_CUTS`) and the
    cuda backend's conformance in float32 through Triton's interpreter, with the `NEWEST` releases
    (the other packages do not import Triton); report in reports/newest-cuda-interpret/.
    Arguments after -- go to the unit tests' pytest (``-k ""`` runs them all)."""
    _release_checks(session, NEWEST, ("kpt-triton", "kpt-cuda", "kpt-rocm", "kpt-xpu"), "newest-cuda-interpret", {},
                    NEWEST_CUTS)


@nox.session(default=False)
def oldest(session: nox.Session) -> None:
    """Every package's unit tests and the cuda backend's conformance in float32 through Triton's
    interpreter, on the CPU, with the `OLDEST` releases; report in reports/oldest-cuda-interpret/.
    Runs on a machine with an NVIDIA GPU, which it hides: on a CPU machine torch 2.11's only build
    on PyPI would download gigabytes of CUDA wheels."""
    if not HAS_NVIDIA_GPU:
        session.error("torch 2.11 has no CPU build on PyPI: run this session on a machine with an NVIDIA GPU")
    _release_checks(session, OLDEST, PACKAGES, "oldest-cuda-interpret", {"CUDA_VISIBLE_DEVICES": ""})


@nox.session(default=False)
def fuzz(session: nox.Session) -> None:
    """A larger budget of fuzzed calls than CI's: ``-- N M`` invalid calls (default 2000) and valid
    calls against the oracle (default 200) per kernel, on every profile of `PROFILES` (the Triton
    backends through the interpreter on a CPU machine, kpt-mps through its emulator)."""
    invalid, valid = (*session.posargs, *("2000", "200")[len(session.posargs):])[:2]
    for profile in PROFILES:
        backend, packages, extra, env = PROFILES[profile]
        _install(session, *packages, extra=extra)
        session.run("kpt", "check", "--backend", backend, "--force", "--report", f"reports/fuzz-{profile}", "--",
                    "-k", "fuzz", "--kpt-fuzz-examples", invalid, "--kpt-fuzz-valid-examples", valid, env=env)


def _readme_install_lines() -> dict[str, str]:
    """README.md's install commands (the lines between its install markers), by the backend each
    installs: the name of its last package folder (``packages/kpt-cuda``: cuda; kpt-core: reference)."""
    text = Path("README.md").read_text()
    block = text.partition("<!-- install -->")[2].partition("<!-- /install -->")[0]
    lines = [line.partition("#")[0].strip() for line in block.splitlines() if line.strip().startswith("pip ")]
    last = {line: line.split()[-1].removeprefix("packages/kpt-") for line in lines}
    return {("reference" if name == "core" else name): line for line, name in last.items()}


INSTALL_LINES = _readme_install_lines()
# a check after the install: the backend is registered with no plugin error; where it can run here,
# one rms_norm call on it
INSTALLED_CHECK = """import sys, torch, kpt
info = {i.name: i for i in kpt.list_backends()}
name = sys.argv[1]
assert name in info and info[name].error is None, f"{name}: {info.get(name)}"
print(info[name])
if info[name].available:
    print(kpt.get_backend(name).rms_norm(torch.randn(2, 8), torch.ones(8)).shape)
"""


@nox.session
@nox.parametrize("backend", list(INSTALL_LINES))
def install(session: nox.Session, backend: str) -> None:
    """README.md's install command for ``backend``, run as written in this fresh virtualenv (pip from
    the checkout, pinned by constraints/ci.txt), then the backend looked up through kpt."""
    session.run("bash", "-euc", INSTALL_LINES[backend], external=True)
    session.run("python", "-c", INSTALLED_CHECK, backend)


@nox.session
def example(session: nox.Session) -> None:
    """The example backend from outside kpt's packages, checked as a vendor checks one: installed
    beside kpt-core and the suite, `kpt check` run from a temporary directory, its report asserted."""
    _install(session)
    session.install(*CONSTRAINTS, EXAMPLE)
    session.run("pytest", "-q", "-p", "no:cacheprovider", f"{EXAMPLE}/tests", *session.posargs)


@nox.session(default=False)
def vendor(session: nox.Session) -> None:
    """`kpt check` on every backend of a package from outside kpt: ``nox -s vendor -- PATH_OR_REQUIREMENT``;
    reports in reports/vendor-<backend>/."""
    if not session.posargs:
        session.error("name the backend package: nox -s vendor -- ../kpt-acme (a path or a requirement)")
    _install(session)
    session.install(*CONSTRAINTS, *session.posargs)
    listed = session.run("python", "-c", "import kpt; print(*(i.name for i in kpt.list_backends()))", silent=True)
    for backend in listed.split():
        if backend != "reference":
            session.run("kpt", "check", "--backend", backend, "--force", "--report", f"reports/vendor-{backend}")


def _write_report(session: nox.Session, reports: list[Path]) -> None:
    """Gather the conformance tables ``reports`` (conformance.md files) into reports/conformance.md."""
    parts = [p.read_text() for p in reports if p.is_file()]
    if not parts:
        session.error("no conformance reports under reports/: run `nox -s main` or `nox -s conformance` first")
    Path("reports/conformance.md").write_text("# kpt conformance report\n\n" + "\n".join(parts))
    session.log("wrote reports/conformance.md:\n\n" + "\n".join(parts))


@nox.session(venv_backend="none")
def report(session: nox.Session) -> None:
    """Gather every profile's conformance table into reports/conformance.md."""
    _write_report(session, sorted(Path("reports").glob("*/conformance.md")))


# the main job's seconds per profile on a 2-core CPU machine, two at a time with one thread each
# (measured; for the estimate of what is left), longest first: the order the job starts them in
MAIN_EXPECTED_S = {"cuda-interpret": 245, "rocm-interpret": 185, "xpu-interpret": 175, "fpga-sim-fixed": 105,
                   "mps-emulate": 70, "reference": 50, "fpga-sim": 50}
MAIN_WORKERS = 2  # one profile per core: most of a profile's time is one Python thread


@nox.session(default=False)
def main(session: nox.Session) -> None:
    """The main job: `kpt check` on every profile of `PROFILES` in one virtualenv (every package),
    the simulated ones at CI's cut (`CUTS`), two at a time with one thread each, a line per profile
    as it ends (its time, the time so far, an estimate of what is left), then reports/conformance.md.
    Each profile's output goes to build/main/<profile>.log; a failing profile's tail is printed.
    ``nox -s conformance report`` runs every profile at full depth, one virtualenv each."""
    _install(session, *PACKAGES[len(BASE) :], extra=("numpy",))
    logs = Path("build/main")
    logs.mkdir(parents=True, exist_ok=True)
    profiles = sorted(PROFILES, key=lambda p: -MAIN_EXPECTED_S.get(p, 60))
    started, running, done = time.monotonic(), {}, []
    path = os.pathsep.join([session.bin, os.environ.get("PATH", "")])

    def check(profile: str) -> tuple[str, int, float]:
        backend, _, _, env = PROFILES[profile]
        running[profile] = time.monotonic()
        command = ["kpt", "check", "--backend", backend, "--force", "--report", f"reports/{profile}",
                   "--xfails", "conformance/xfails", "--", *CUTS.get(profile, ()), *session.posargs]
        with open(logs / f"{profile}.log", "w") as log:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PATH": path, **ONE_THREAD, **env})
            _, status, usage = os.wait4(child.pid, 0)  # its CPU time: what it costs on a machine of its own
        code = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - running.pop(profile)
        done.append(profile)
        now = time.monotonic()
        waiting = [p for p in profiles if p not in done and p not in running]
        left = sum(MAIN_EXPECTED_S.get(p, 60) for p in waiting) + sum(
            max(0, MAIN_EXPECTED_S.get(p, 60) - (now - t)) for p, t in running.items())
        session.log(f"[{len(done)}/{len(profiles)}] {profile} {'passed' if code == 0 else 'FAILED'} in "
                    f"{seconds:.0f} s ({usage.ru_utime + usage.ru_stime:.0f} s of CPU); {now - started:.0f} s so far, "
                    f"about {left / MAIN_WORKERS:.0f} s left")
        return profile, code, seconds

    session.log(f"{len(profiles)} profiles, {MAIN_WORKERS} at a time: {', '.join(profiles)}; logs in {logs}/")
    with ThreadPoolExecutor(MAIN_WORKERS) as pool:
        results = list(pool.map(check, profiles))
    _write_report(session, [Path(f"reports/{p}/conformance.md") for p in profiles])
    failed = [p for p, code, _ in results if code != 0]
    for profile in failed:
        tail = (logs / f"{profile}.log").read_text().splitlines()[-30:]
        session.log(f"{profile} failed; the end of {logs}/{profile}.log:\n" + "\n".join(tail))
    if failed:
        session.error(f"failed: {', '.join(failed)} ({time.monotonic() - started:.0f} s)")
    session.log(f"every profile passed in {time.monotonic() - started:.0f} s")


# backend -> the arch tags compiled ahead of time: every one by aot_all, CI's cut (AOT_CI) by aot
AOT_TARGETS = {"rocm": ("gfx942", "gfx950", "gfx90a", "gfx1100", "gfx1201"),
               "cuda": ("sm80", "sm90", "sm90-hbm3e", "sm100")}
AOT_CI = {"rocm": ("gfx942",)}


def _aot(session: nox.Session, targets: dict[str, tuple[str, ...]], *scope: str) -> None:
    """`python -m kpt_triton.aot` for each target, without a GPU: fails on a compile error, shared
    memory / LDS over the limit, or a spill the tuning table does not accept."""
    for backend, archs in targets.items():
        for arch in archs:
            session.run("python", "-m", "kpt_triton.aot", "--backend", backend, "--arch", arch, *scope,
                        env={"TRITON_INTERPRET": "0"})


@nox.session
def aot(session: nox.Session) -> None:
    """CI's cut of the ahead-of-time compile: every conformance case's specialization of every kernel
    for `AOT_CI` (gfx942: AMD has no GPU of ours to run them) in float32 and bfloat16 (float16's 16-bit
    tiles are bfloat16's), the docs/performance.md shapes for the other targets, sm90 included (its
    kernels run on lent H100s and H200s); `aot_all` compiles every case and dtype for every target.
    gfx942 and sm90 at every case and dtype took 1,339 s of a CI run on 2 shared cores (2,430 of the
    2,745 specializations); gfx942 in two dtypes is 807."""
    _install(session, "kpt-triton", "kpt-cuda", "kpt-rocm")
    _aot(session, AOT_CI, "--dtypes", "float32,bfloat16")
    _aot(session, {b: tuple(a for a in archs if a not in AOT_CI.get(b, ())) for b, archs in AOT_TARGETS.items()},
         "--perf-shapes")


@nox.session(default=False)
def aot_all(session: nox.Session) -> None:
    """Every conformance case's specialization of every kernel for every target (`AOT_TARGETS`)."""
    _install(session, "kpt-triton", "kpt-cuda", "kpt-rocm")
    _aot(session, AOT_TARGETS)


@nox.session
def usage(session: nox.Session) -> None:
    """What a newcomer meets first, on the installed packages: every kernel compiled before any
    eager call, forward and backward, in a fresh process per conformance profile; the README's
    Python snippets (transformers installed for the one that patches a model); mypy over a user's
    first script and over every package that ships py.typed (tests/). The `models` sessions test
    kpt.patch itself."""
    _install(session, *PACKAGES[len(BASE):], extra=USAGE_EXTRA)
    for backend, _, _, env in PROFILES.values():
        session.run("python", "scripts/compile_first.py", "--backend", backend, env=env)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests", *session.posargs)


USAGE_EXTRA = ("numpy", "mypy", "transformers", "accelerate", "matplotlib")


# the transformers releases `models` runs against: the oldest kpt.patch supports and the newest
TRANSFORMERS = {"oldest": "5.17.0", "newest": "5.25.0"}


@nox.session
@nox.parametrize("transformers", list(TRANSFORMERS))
def models(session: nox.Session, transformers: str) -> None:
    """`kpt.patch` on tiny random-initialised transformers models of every supported family, with the
    `TRANSFORMERS` release pinned over constraints/ci.txt: patched and unpatched forward, loss,
    gradients and a training step agree, on the reference backend and on the cuda backend (through
    Triton's interpreter on a CPU machine); the auto loader, the transformers Trainer and PEFT's
    adapters on a patched model; scripts/train_llama.py --tiny."""
    constraints = _pinned(session, {"transformers": TRANSFORMERS[transformers]})
    paths = [f"packages/{p}" for p in PACKAGES]
    session.install("-c", constraints, "pytest", "peft", *USAGE_EXTRA, *paths)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "models", *session.posargs, env=CUDA_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the repository; the results tables (benchmarks/<device>.md, README.md's) as
    scripts/results_table.py writes them from benchmarks/<device>.json."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("python", "scripts/results_table.py", "--check")


def _distributions() -> list[Path]:
    """Every package under packages/ (a folder with a pyproject.toml): each is a published distribution."""
    return sorted(p for p in Path("packages").iterdir() if (p / "pyproject.toml").is_file())


@nox.session
def wheels(session: nox.Session) -> None:
    """Every distribution under packages/ as a user gets it: built (sdist, then the wheel from the
    sdist), checked with ``twine check --strict``, the wheels installed (not the source tree, not
    editable) into this fresh environment, then every package's unit tests (kpt-triton's cut to
    `WHEELS_CUTS`) and the reference conformance run against them, so a file missing from a wheel
    (CUDA C sources, tuning tables, Metal sources) fails here. Distributions land in
    .nox/wheels/tmp/dist/."""
    session.install(*CONSTRAINTS, "build", "twine", "setuptools")
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    packages = _distributions()
    for package in packages:
        # --no-isolation: the pinned setuptools of this session, which must satisfy each package's floor
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), str(package), silent=True)
    session.run("twine", "check", "--strict", *map(str, sorted(dist.iterdir())))
    # what the tests need besides the wheels, as in `tests`: numpy (Triton's interpreter), matplotlib
    # (kpt-core's roofline test), rich (kpt-core[cli])
    session.install(*CONSTRAINTS, "pytest", "numpy", "matplotlib", "rich", *map(str, sorted(dist.glob("*.whl"))))
    session.run("python", "scripts/installed_from_wheels.py", *map(str, packages))
    for package in packages:
        session.run("pytest", "-q", "-p", "no:cacheprovider", f"{package}/tests", *WHEELS_CUTS.get(package.name, ()),
                    *session.posargs, env={"TRITON_INTERPRET": "1"})
    # the installed kpt-conformance on the installed kpt-core, two kernels in float32 (every kernel and
    # dtype of the reference runs in `conformance(profile='reference')`, on wheels pip builds likewise)
    session.run("kpt", "check", "--backend", "reference", "--dtypes", "float32", "--kernels", "rms_norm,attention",
                "--force", "--report", "reports/wheels-reference", "--xfails", "conformance/xfails")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (docs/, mkdocs.yml) built with warnings as errors into build/site;
    its kernel reference is written from kpt.SPECS at build time."""
    _install(session, extra=("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python"))
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(default=HAS_NVIDIA_GPU)
@nox.parametrize("backend", ["cuda"])
def bench(session: nox.Session, backend: str) -> None:
    """Benchmarks against torch eager and torch.compile on the backend's device (needs a GPU: not
    among the sessions a plain ``nox`` runs on a machine without one)."""
    _, packages, extra, _ = next(p for p in PROFILES.values() if p[0] == backend)
    _install(session, *packages, extra=extra)
    session.run("python", "-m", "kpt.bench", "--backend", backend, "--out", f"reports/bench-{backend}",
                *session.posargs)
