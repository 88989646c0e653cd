"""Without a GPU the backend runs in the Triton interpreter; the switch must be set before
``triton`` is first imported, hence here."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
