"""How close a backend's result must be to the float64 oracle.

A result ``out`` passes against the oracle ``ref`` when it has no NaN where the oracle has none,
and both

* ``‖out − ref‖₂ / ‖ref‖₂ ≤ rel_norm`` (the whole tensor), and
* ``|out − ref| ≤ atol · max|ref| + rtol · |ref|`` for every element (``atol`` is relative to the
  tensor's largest magnitude, so one table serves tensors of any scale).

``abs_floor`` (default 0: no floor) is an absolute error in the output's units that is always
allowed: ``atol · max|ref|`` is raised to it, and ``rel_norm · ‖ref‖₂`` to ``abs_floor · √n`` (that
floor on each of the n elements). It is for number formats whose error does not shrink with the
result: a fixed-point backend states it from its format's step and the magnitudes of the call's
inputs, so that an output that happens to be small (a lone value, a gradient times a small
upstream gradient) is not held to a bound finer than the format's step.

Two rules of `kpt.testing` adjust a tolerance per call. A gradient whose oracle is (nearly) all
zeros (below float32's rounding of its natural scale S, e.g. dq of causal attention with one key)
gets the floor ``atol · S``, S taken from the inputs' magnitudes and the loss response
(`kpt.testing.gradient_floor`). An ill-conditioned case (``Case.eager_factor = k``) passes within
``max(table, k × the error of the reference math run in the dtype under test)``, both measured as
the worst error over tolerance (`kpt.testing.eager_widened`).

Roundings the contract permits are allowed per element besides, as their bound
(each spec's `kpt.KernelSpec.rounding`), each far more than the tolerance where terms nearly cancel:
attention's backward may take ``rowsum(p ⊙ dp)`` as ``rowsum(dO ⊙ o)`` from ``o`` in the inputs'
dtype (as FlashAttention does), which moves dq and dk (`kpt.kernels.attention.attention_rounded_o`);
linear's backward may round ``dpre = dy ⊙ act'(pre)`` to the inputs' dtype (the operand of its
products, as eager does), which moves dx, dweight and dbias (`kpt.kernels.linear.linear_rounded_dpre`),
and linear_cross_entropy's backward may round its logits' gradient ``dz`` the same way, and its
logits to the inputs' dtype as ``linear`` returns them, which moves every gradient
(`kpt.kernels.cross_entropy.linear_cross_entropy_rounded`; the loss itself by
`kpt.kernels.cross_entropy.linear_cross_entropy_loss_rounded`, which kpt-triton's unit tests of
logits near ±300 apply; the conformance suite's cases average enough rows for the table to hold);
add_rms_norm normalizes ``h = x + residual`` rounded to the inputs' dtype (to either neighbour of
the exact sum), which moves dx and dresidual (`kpt.kernels.rms_norm.add_rms_norm_rounded_h`); softmax's
backward takes ``y`` in the inputs' dtype (the saved output), whose rounded probabilities need not
sum to 1, which moves dx (`kpt.kernels.softmax.softmax_rounded_y`).
Where a derivative jumps (relu's at 0), a pre-activation within the forward's rounding of the
jump may take either derivative, the one its own forward output shows
(`kpt.kernels.linear.linear_relu_kernel_side`, `kpt.KernelSpec.kink`).

Differences up to the output dtype's spacing near zero (``finfo.tiny * finfo.eps``: float16's
subnormal step, 6e-8) are not counted: no result stored in that dtype can be closer. Integer
outputs (indices, offsets) must match exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rel_norm: float
    atol: float
    rtol: float
    reason: str = ""
    abs_floor: float = 0.0

    def scaled(self, factor: float, why: str) -> Tolerance:
        """Every bound (the floor included) ``factor`` times wider, ``why`` added to the reason."""
        return Tolerance(self.rel_norm * factor, self.atol * factor, self.rtol * factor, f"{self.reason}; {why}",
                         self.abs_floor * factor)


DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-12, 1e-12, 1e-10, "float64 is the oracle's own precision"),
    # float32 accumulation of a few thousand terms; unit roundoff 6e-8
    torch.float32: Tolerance(2e-5, 2e-5, 1e-4, "float32 arithmetic, float32 accumulation"),
    # one rounding of the output costs up to 4.9e-4 relative; a few roundings inside
    torch.float16: Tolerance(2e-3, 2e-3, 1e-2, "float16 inputs and outputs, float32 accumulation"),
    # one rounding of the output costs up to 3.9e-3 relative; a few roundings inside
    torch.bfloat16: Tolerance(1.6e-2, 1.6e-2, 4e-2, "bfloat16 inputs and outputs, float32 accumulation"),
    # one step of a 3-bit mantissa is 12.5% relative: one rounding difference of the scaled value
    torch.float8_e4m3fn: Tolerance(7e-2, 2e-3, 0.13, "float8 e4m3 output: one rounding step"),
    torch.float8_e5m2: Tolerance(1.4e-1, 2e-3, 0.26, "float8 e5m2 output: one rounding step"),
}


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    return DEFAULT_TOLERANCES[dtype]
