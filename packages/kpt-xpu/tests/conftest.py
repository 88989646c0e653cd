"""Without an Intel GPU the backend runs in the Triton interpreter; the switch must be set before
``triton`` is first imported, hence here."""

from __future__ import annotations

import os

import torch

if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")
