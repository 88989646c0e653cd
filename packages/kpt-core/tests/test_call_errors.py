"""Mistakes in a kernel call are the caller's `KernelInputError`, naming the argument; what the
machine runs out of (host memory) is torch's own error, never blamed on the backend."""

from __future__ import annotations

import pytest
import torch

import kpt

REF = kpt.get_backend("reference")


@pytest.mark.parametrize("ignore_index", [-(2**63) - 1, 2**63, 2**2000], ids=["below", "above", "huge"])
def test_an_ignore_index_outside_int64_names_the_argument(ignore_index: int) -> None:
    logits, target = torch.randn(4, 8), torch.randint(0, 8, (4,))
    with pytest.raises(kpt.KernelInputError, match=r"cross_entropy: argument 'ignore_index' .*int64") as info:
        REF.cross_entropy(logits, target, ignore_index=ignore_index)
    assert len(str(info.value)) < 200  # a 600-digit integer is not printed whole


@pytest.mark.parametrize("kernel, call", [
    ("rms_norm", lambda x: REF.rms_norm(x, eps=2**2000)),
    ("layer_norm", lambda x: REF.layer_norm(x, eps=2**1100)),
])
def test_an_eps_no_float_holds_is_the_callers_error(kernel: str, call) -> None:
    with pytest.raises(kpt.KernelInputError, match=rf"{kernel}: argument 'eps' .*too large for a float64"):
        call(torch.randn(2, 8))


def test_a_misspelled_keyword_names_the_kernel_and_its_parameters() -> None:
    x, w = torch.randn(2, 8), torch.ones(8)
    message = r"rms_norm: no parameter 'wieght' \(did you mean 'weight'\?\); its parameters: rms_norm\(x, weight=None"
    with pytest.raises(kpt.KernelInputError, match=message):
        REF.rms_norm(x, wieght=w)
    with pytest.raises(kpt.KernelInputError, match=r"softmax: missing 1 required positional argument: 'x'"):
        REF.softmax()
    with pytest.raises(kpt.KernelInputError, match=r"silu: takes at most 1 arguments, 2 were given"):
        REF.silu(x, x)


def test_a_type_error_inside_a_call_is_not_taken_for_a_misspelled_keyword() -> None:
    from kpt.reference import ReferenceBackend

    class Raising(ReferenceBackend):
        name = "fixture-type-error"

        def call(self, kernel, *args, **kwargs):
            raise TypeError("raised inside")

    with pytest.raises(TypeError, match="raised inside") as info:
        Raising().silu(torch.randn(2))
    assert not isinstance(info.value, kpt.KernelInputError)


def test_running_out_of_host_memory_is_torchs_error_not_the_backends() -> None:
    huge = torch.ones(1, 1).expand(2**48, 1)  # no memory until the kernel allocates its 1 PiB output
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        REF.rms_norm(huge)
    assert not isinstance(info.value, kpt.BackendError)


def test_a_dtype_is_listed_once_in_the_expected_ones() -> None:
    with pytest.raises(kpt.KernelInputError, match=r"expected one of: float32$"):
        REF.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.float64))


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")  # the shape without the memory


@pytest.mark.parametrize("kernel, args, arg", [
    ("moe_gating", lambda: (_meta(1, 2**31), 1), "logits"),
    ("moe_dispatch", lambda: (_meta(2**30, 1), _meta(2**30, 2, dtype=torch.int32), 4), "indices"),
    ("grouped_linear", lambda: (_meta(2**31, 1), _meta(3, dtype=torch.int32), _meta(2, 1, 1)), "x_sorted"),
    ("moe_combine", lambda: (_meta(2**31, 1), _meta(2**31, dtype=torch.int32), _meta(2**30, 2)), "order"),
])
def test_routing_that_int32_cannot_number_is_refused(kernel: str, args, arg: str) -> None:
    with pytest.raises(kpt.KernelInputError, match=rf"{kernel}: argument '{arg}' has 2147483648 .*int32"):
        REF.call(kernel, *args())


def test_routing_just_below_the_int32_limit_is_accepted() -> None:
    x, indices = _meta(2**30 - 1, 1), _meta(2**30 - 1, 2, dtype=torch.int32)
    x_sorted, offsets, order = REF.moe_dispatch(x, indices, 4)
    assert order.shape == (2**31 - 2,) and order.dtype == torch.int32
