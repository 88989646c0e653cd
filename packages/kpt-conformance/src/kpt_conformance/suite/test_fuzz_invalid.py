"""Property-based fuzzing of invalid calls: every one raises a kpt error and changes no input.

Hypothesis starts from a valid call (a random conformance case of the kernel, in a dtype of the
backend) and breaks one argument in a way the contract never accepts: a float tensor turned into
an integer one, an index tensor into a float one, a tensor into a nested list or ``None``, a
dimension added to a tensor whose rank the contract fixes, a scalar argument into a string that
names nothing. The call must raise `kpt.KernelInputError` (or `kpt.KernelNotSupportedError`),
never another exception, and leave every input bit for bit as it was.

Bounded by ``--kpt-fuzz-examples`` per kernel (CI runs the default; ``nox -s fuzz`` many more).
Hypothesis's choices come from the run's seed, so ``kpt check --seed N`` replays them; a failure
prints the falsifying call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import kpt
from kpt.testing import modified, snapshot, to_device
from kpt_conformance.plugin import run_of

FIXED_RANK = ("weight", "bias", "target", "indices", "offsets", "order", "weights", "logits", "x_sorted",
              "y_sorted", "hidden", "q", "k", "v", "wq")
"""Tensor arguments whose rank the contract fixes (an extra dimension is always invalid); the
activations of row-wise kernels take any leading dimensions, so they are not among them."""


def _break(arg: str, value: Any, how: str) -> Any:
    """``value`` made invalid for ``arg`` in the way ``how`` names, or None if that way does not apply."""
    if isinstance(value, torch.Tensor):
        if how == "dtype":
            if value.is_floating_point():
                return value.to(torch.int64)
            return value.to(torch.float32)
        if how == "list":
            return value.tolist()
        if how == "rank" and arg in FIXED_RANK:
            return value.unsqueeze(0)
        return None
    if how == "string" and not isinstance(value, str) and value is not None:
        return "not-a-valid-value"
    if how == "string" and isinstance(value, str):
        return value + "-unknown"
    return None


@st.composite
def invalid_calls(draw: Any, spec: kpt.KernelSpec, dtypes: tuple[torch.dtype, ...]) -> tuple[str, str, dict]:
    cases = [c for c in spec.cases() if not c.device_only]
    case = draw(st.sampled_from(cases))
    allowed = [d for d in dtypes if case.dtypes is None or d in case.dtypes]
    dtype = draw(st.sampled_from(allowed or list(dtypes)))
    args = case.make(torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))), dtype)
    breakable = [(a, how) for a in args for how in ("dtype", "list", "rank", "string")
                 if _break(a, args[a], how) is not None]
    arg, how = draw(st.sampled_from(breakable))
    return arg, how, {**args, arg: _break(arg, args[arg], how)}


def _check(backend: kpt.Backend, device: torch.device, spec: kpt.KernelSpec, call: tuple[str, str, dict]) -> None:
    arg, how, args = call
    args = to_device(args, device)
    before = snapshot(args)
    with pytest.raises((kpt.KernelInputError, kpt.KernelNotSupportedError)):
        backend.call(spec.name, **args)
    changed = modified(args, before)
    assert not changed, f"{spec.name}, '{arg}' broken ({how}): {'; '.join(changed)}"


@pytest.mark.parametrize("spec", list(kpt.SPECS.values()), ids=list(kpt.SPECS))
def test_invalid_calls_raise_kpt_errors(request: pytest.FixtureRequest, backend: kpt.Backend,
                                        device: torch.device, spec: kpt.KernelSpec, record_property) -> None:
    record_property("kpt", {"kernel": spec.name, "kind": "errors", "case": "fuzzed invalid calls"})
    config = request.config
    run = settings(max_examples=config.getoption("--kpt-fuzz-examples"), deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))(
        given(call=invalid_calls(spec, run_of(config).dtypes))(
            lambda call: _check(backend, device, spec, call)))
    seed(run_of(config).seed(request.node.nodeid))(run)()
