"""One test per kernel of the contract: does the backend provide it (forward and backward)?"""

from __future__ import annotations

import pytest

import kpt


@pytest.mark.parametrize("kernel", list(kpt.SPECS))
def test_kernel_present(pytestconfig: pytest.Config, kernel: str, record_property) -> None:
    record_property("kpt", {"kernel": kernel, "kind": "present"})
    be = pytestconfig.kpt_backend
    if be is None:
        pytest.fail(pytestconfig.kpt_unusable, pytrace=False)
    missing = kpt.missing_kernels(be.kernels())
    assert kernel not in missing, f"backend {be.name!r} is missing kernel {kernel!r}"


def test_backend_usable(pytestconfig: pytest.Config) -> None:
    assert not pytestconfig.kpt_unusable, pytestconfig.kpt_unusable
