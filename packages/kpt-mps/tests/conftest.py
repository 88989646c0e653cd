from __future__ import annotations

import pytest
from kpt_mps import metal


@pytest.fixture
def emulated(monkeypatch):
    """Every kernel through the Metal emulator on CPU tensors, as ``KPT_MPS_EMULATE=1`` does."""
    monkeypatch.setenv("KPT_MPS_EMULATE", "1")
    yield
    metal._library.cache_clear()
