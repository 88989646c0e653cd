"""One test per kernel of the contract: does the backend provide it, forward and backward?"""

from __future__ import annotations

import pytest

import kpt
from kpt_conformance.plugin import run_of

BODY_SUFFIX = {"forward": "fwd", "backward": "bwd"}
"""What `kpt.kernels_from` calls each body of a kernel."""


@pytest.mark.parametrize("kernel", list(kpt.SPECS))
def test_kernel_present(pytestconfig: pytest.Config, kernel: str, record_property) -> None:
    run = run_of(pytestconfig)
    missing = run.missing.get(kernel, ())
    record_property("kpt", {"kernel": kernel, "kind": "present", "missing": list(missing)})
    bodies = " and ".join(f"{kernel}_{BODY_SUFFIX[part]}" for part in missing)
    if missing:
        pytest.fail(f"backend {run.backend.name!r} is missing kernel {kernel!r}: "
                    f"{' and '.join(missing)} (kpt.kernels_from looks for {bodies})", pytrace=False)
