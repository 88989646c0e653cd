"""The kernel contract: one `KernelSpec` per kernel, one module per kernel family.

``SPECS`` maps every kernel name of the contract to its spec, in the contract's order (that of
the kernel reference, docs/reference/kernels.md).

Special values
--------------
Inputs may hold ±0, subnormals, ±max of their dtype, ±inf and NaN; every kernel's result for them
is its reference math's (the float64 oracle), with these rules where that math is silent:

* NaN propagates: an output that depends on a NaN input is NaN (a row-wise kernel's whole row, a
  product's row and column, a loss whose row holds one), never a value a GPU's NaN-dropping
  minimum or maximum would give. ``relu(NaN)`` is NaN; ``quantize_fp8`` of a row (or tensor)
  holding a NaN has a NaN scale, so every value quantized with it is NaN.
* Infinities follow IEEE arithmetic through the reference math: ``softmax`` of a row holding +inf
  is NaN (inf − inf), ``cross_entropy`` of a row with a +inf logit is +inf (NaN where the target
  or label smoothing takes that logit), a -inf logit is a class of probability 0.
* The computation runs in float32 at least: where an intermediate value that the semantics name
  (a square, a sum of squares, a product, ``x + residual``) overflows float32 for ±max inputs, a
  kernel may return what that float32 computation gives (inf, NaN, or 0 after an infinite
  denominator) instead of the float64 oracle's value; nowhere else. The order of a sum is not
  fixed, so an output that depends on a ±max input and overflows in float32 where the oracle is
  finite — in the reference's order or in the kernel's — is open: another order overflows
  differently (−inf where torch gets inf − inf = NaN) or not at all.
* Subnormal inputs are values like any other (no flush to zero in the inputs' dtype); signed
  zeros compare equal.
* What is left out adds nothing, not 0 · inf = NaN: a row that ``cross_entropy`` or
  ``linear_cross_entropy`` ignores has a zero gradient and adds nothing to the weight's and bias's
  gradients, whatever its values; an expert's ``grouped_linear`` gradients see only its own rows
  and weight.
* Attention's causal mask allows either: an inf or NaN met only in (query, key) pairs that the
  mask hides may or may not reach a gradient. Each element of ``dq``, ``dk`` and ``dv`` must equal,
  by the usual tolerance and these rules, either the reference's value (its dense products carry
  such a value on as ``0 · inf = NaN``) or the value where the hidden pairs add nothing (what a
  kernel that skips them gives). The forward has no such choice: ``o`` is the reference's dense
  ``p · v``, so an inf or NaN in a value row makes its column of ``o`` NaN for the queries it is
  hidden from too.

The conformance suite fuzzes every kernel with such values against the oracle by these rules,
forward and backward (``test_fuzz_valid.py``; attention's gradients against both of their
values); a backend whose number format has no special values (a fixed-point design) says so in
`kpt.Backend.special_values` and is fuzzed with finite values only.
"""

from __future__ import annotations

import importlib
import types

from ..spec import KernelSpec
from . import activations, attention, cross_entropy, fp8, layer_norm, linear, moe, rms_norm, rope, softmax

FAMILIES: tuple[types.ModuleType, ...] = (
    rms_norm, layer_norm, softmax, activations, rope, attention, linear, cross_entropy, moe, fp8)
"""The kernel families, one module each, in the contract's order: the one list of them."""

SPECS: dict[str, KernelSpec] = {spec.name: spec for family in FAMILIES for spec in family.SPECS}


def family_name(spec: KernelSpec) -> str:
    """The family of a kernel: the name of the module that defines its spec (``rms_norm`` for
    ``add_rms_norm``), which names its module in every backend package too."""
    return spec.forward.__module__.rpartition(".")[2]


def family_modules(package: str) -> tuple[types.ModuleType, ...]:
    """``package``'s module of each kernel family (``<package>.rms_norm``...), in the order of
    `SPECS`: how a backend that keeps one module per family finds its bodies."""
    names = dict.fromkeys(family_name(spec) for spec in SPECS.values())
    return tuple(importlib.import_module(f"{package}.{name}") for name in names)
