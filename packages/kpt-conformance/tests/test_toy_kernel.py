"""Adding a kernel touches only its own files: a toy kernel family, written into a temporary tree
as CONTRIBUTING.md's "Adding a kernel" says (a spec and reference in ``kpt/kernels/toy.py``, a
Triton body in ``kpt_triton/toy.py``), joins the contract the way a new family does (its module in
``kpt.kernels.FAMILIES``, its specs in ``kpt.SPECS``), and `kpt check` generates and passes its
conformance cases on the reference backend and on kpt-cuda through Triton's interpreter. A wrong
body fails them. The reference backend needs no body (it runs the spec's reference); kpt-triton
finds ``toy.py`` by the family's name, as every backend package does.

The runs go in one fresh process (`DRIVER`): the suite parametrizes over ``kpt.SPECS`` when it is
collected, and a backend's ops are those of ``kpt.SPECS`` when it first registers them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("kpt_cuda")
pytest.importorskip("numpy")  # Triton's interpreter

SPEC = '''
"""A toy family: ``toy_scale(x, alpha) = x · alpha + 1``."""

from __future__ import annotations

import torch
from torch import Tensor

from kpt.spec import Args, BadInput, Case, Check, KernelSpec, compute_dtype, each_dim, randn, strided


def toy_scale(x: Tensor, alpha: float = 2.0) -> Tensor:
    """Scale and shift: ``y = x * alpha + 1``, in float32 (float64 for float64), like x.
    Differentiable with respect to ``x``."""
    raise AssertionError("signature only: call backend.toy_scale")


def validate_toy_scale(a: Args, dtypes: tuple[torch.dtype, ...]) -> Args:
    c = Check("toy_scale", dtypes)
    c.tensor("x", a["x"])
    c.number("alpha", a["alpha"])
    return a


def toy_scale_fwd(x: Tensor, alpha: float) -> tuple[Tensor]:
    # contiguous, as the contract's outputs are: elementwise ops keep a transposed input's layout
    return ((x.to(compute_dtype(x.dtype)) * alpha + 1).to(x.dtype).contiguous(),)


def toy_scale_bwd(x: Tensor, alpha: float, y: Tensor, dy: Tensor | None) -> tuple[Tensor]:
    if dy is None:
        return (torch.zeros_like(x),)
    return ((dy.to(compute_dtype(x.dtype)) * alpha).to(x.dtype).contiguous(),)


def _case(name: str, *shape: int, layout=lambda t: t) -> Case:
    return Case(name, lambda g, dtype: {"x": layout(randn(g, *shape, dtype=dtype)), "alpha": 0.75})


TOY_SCALE = KernelSpec(
    name="toy_scale",
    signature=toy_scale,
    validate=validate_toy_scale,
    forward=toy_scale_fwd,
    backward=toy_scale_bwd,
    outputs=("y",),
    differentiable=("x",),
    flops=lambda a: 2.0 * a["x"].numel(),
    cases=lambda: [_case("odd", 3, 17), _case("strided", 33, 64, layout=strided), _case("empty", 0, 8),
                   Case("perf", lambda g, dtype: {"x": randn(g, 4096, 4096, dtype=dtype), "alpha": 0.75},
                        perf=True)],
    bad_inputs=lambda: [BadInput("int_x", lambda: {"x": torch.ones(3, dtype=torch.int64), "alpha": 2.0}),
                        BadInput("alpha_text", lambda: {"x": torch.ones(3), "alpha": "two"})],
    sharding=lambda a: each_dim(range(a["x"].ndim), ("y",), ("x",)),
    memory_bound=True,
)

SPECS = (TOY_SCALE,)
'''

BODY = '''
"""The toy family's Triton body."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, alpha, shift, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(y_ptr + offsets, (x * alpha + shift).to(y_ptr.dtype.element_ty), mask=mask)


def _scale(t, alpha, shift, block):
    t = t.contiguous()
    out = torch.empty_like(t)
    if t.numel():
        _scale_kernel[(triton.cdiv(t.numel(), block),)](t, out, t.numel(), alpha, shift, BLOCK=block)
    return out


SHIFT = 1.0
"""What the forward adds: 1 is right (the run with a wrong body sets another)."""


def toy_scale_fwd(x, alpha, *, block: int = 1024):
    return (_scale(x, alpha, SHIFT, block),)


def toy_scale_bwd(x, alpha, y, dy, *, block: int = 1024):
    return (torch.zeros_like(x) if dy is None else _scale(dy, alpha, 0.0, block),)
'''

DRIVER = '''
"""Joins the toy family to the contract as one line in ``kpt/kernels/__init__.py`` would, then runs
`kpt check` (`kpt_conformance.check`) of it in float32: on the reference backend, on kpt-cuda, and on
kpt-cuda with a wrong body (a shift of 1.001), the numerics only. Prints each test's outcome."""
import importlib
import json
import os
import sys

import kpt
import kpt.kernels
import kpt_conformance
import kpt_triton

tree = sys.argv[1]
kpt.kernels.__path__.append(os.path.join(tree, "kpt", "kernels"))
kpt_triton.__path__.append(os.path.join(tree, "kpt_triton"))
toy = importlib.import_module("kpt.kernels.toy")
kpt.kernels.FAMILIES += (toy,)
kpt.SPECS.update({spec.name: spec for spec in toy.SPECS})

outcomes = {}
for run, backend, args in [("reference", "reference", []), ("cuda", "cuda", []),
                           ("wrong", "cuda", ["-k", "test_numerics"])]:
    if run == "wrong":
        importlib.import_module("kpt_triton.toy").SHIFT = 1.001
    report = os.path.join(tree, "report-" + run)
    kpt_conformance.check(backend, dtypes=["float32"], kernels=["toy_scale"], report=report, pytest_args=args)
    with open(os.path.join(report, "conformance.json")) as f:
        outcomes[run] = {r["test"]: r["outcome"] for r in json.load(f)["results"]}
print(json.dumps(outcomes))
'''


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """The outcome of each test of the toy kernel by id, for each run of `DRIVER`."""
    tree = tmp_path_factory.mktemp("tree")
    (tree / "kpt" / "kernels").mkdir(parents=True)
    (tree / "kpt_triton").mkdir()
    (tree / "kpt" / "kernels" / "toy.py").write_text(textwrap.dedent(SPEC))
    (tree / "kpt_triton" / "toy.py").write_text(textwrap.dedent(BODY))
    (tree / "driver.py").write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(tree / "driver.py"), str(tree)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("run", ["reference", "cuda"])
def test_a_toy_kernel_joins_the_suite(outcomes: dict[str, dict[str, str]], run: str) -> None:
    ran = outcomes[run]
    # the generated tests: presence, each case forward and backward, the bad inputs, fuzzing
    for part in ("test_kernel_present", "test_forward[toy_scale-odd", "test_backward[toy_scale-strided",
                 "test_bad_input[toy_scale-int_x]", "test_invalid_calls", "test_valid_calls"):
        assert any(part in test for test in ran), (part, ran)
    assert {o for t, o in ran.items() if "test_speed" not in t} == {"passed"}, ran


def test_a_wrong_toy_body_fails(outcomes: dict[str, dict[str, str]]) -> None:
    wrong = outcomes["wrong"]
    assert wrong and all("test_numerics" in test for test in wrong)
    assert wrong["test_numerics.py::test_forward[toy_scale-odd-float32]"] == "failed", wrong
