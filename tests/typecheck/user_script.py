"""A user's first script: type-checked in CI (``nox -s usage``), so that the kernel methods stay
visible to static tools with their argument and return types."""

from __future__ import annotations

import torch

import kpt

be = kpt.get_backend()
x = torch.randn(8, 64, requires_grad=True)
w = torch.ones(64, requires_grad=True)

y: torch.Tensor = be.rms_norm(x, w)
h, residual = be.add_rms_norm(x, x, w, eps=1e-5)
y.square().mean().backward()
compiled = torch.compile(lambda x, w: be.rms_norm(x, w) * 2, fullgraph=True)
print(compiled(x, w).shape, h.shape, residual.shape, kpt.list_kernels())
