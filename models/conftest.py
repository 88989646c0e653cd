"""The models tests compile many small models, each a new object: dynamo's recompiles of the
forwards they share (transformers' and kpt.patch's) would add up, test after test, to its recompile
limit, where ``fullgraph=True`` fails. Each test starts with dynamo's caches empty."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
