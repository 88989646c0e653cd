"""MkDocs hook: the kernel reference (docs/reference/kernels.md) written from ``kpt.SPECS`` at build time.

Every kernel's section comes from its spec, never from prose kept beside it: the signature and
docstring of the method users call, the dtypes its conformance cases run in with the tolerance of
each, the inputs it is differentiable in, the cases whose tolerance is widened and why, and the
invalid calls with the error each must raise. A change to a spec changes the page.
"""

from __future__ import annotations

import inspect

import torch

import kpt
from kpt.tolerance import DEFAULT_TOLERANCES

MARKER = "<!-- generated: kernel sections -->"
TOLERANCE_MARKER = "<!-- generated: tolerance table -->"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _annotation(annotation: object) -> str:
    # postponed annotations are strings already
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _signature(spec: kpt.KernelSpec) -> str:
    sig = inspect.signature(spec.signature)
    params = []
    for p in sig.parameters.values():
        text = p.name if p.annotation is p.empty else f"{p.name}: {_annotation(p.annotation)}"
        params.append(text if p.default is p.empty else f"{text} = {p.default!r}")
    returns = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    return f"```python\nbackend.{spec.name}({', '.join(params)}){returns}\n```"


def _docstring(spec: kpt.KernelSpec) -> str:
    return inspect.cleandoc(spec.signature.__doc__ or "")


def _tolerance_row(dtype: torch.dtype) -> str:
    t = DEFAULT_TOLERANCES[dtype]
    return f"| `{_dtype(dtype)}` | {t.rel_norm:g} | {t.atol:g} | {t.rtol:g} | {t.reason} |"


def tolerance_table() -> str:
    head = "| dtype | rel_norm | atol | rtol | why |\n|---|---|---|---|---|"
    return "\n".join([head, *(_tolerance_row(d) for d in DEFAULT_TOLERANCES)])


def _section(spec: kpt.KernelSpec) -> str:
    cases = spec.cases()
    dtypes = [d for d in kpt.FLOAT_DTYPES if any(c.dtypes is None or d in c.dtypes for c in cases)]
    lines = [f"## `{spec.name}`", "", _signature(spec), "", _docstring(spec), ""]
    grad = ", ".join(f"`{name}`" for name in spec.differentiable)
    lines += [f"**Differentiable** with respect to {grad}." if grad else "**Not differentiable.**", ""]
    lines += ["**Outputs**: " + ", ".join(f"`{o}`" for o in spec.outputs) + ".", ""]
    lines += ["**Dtypes** of the conformance cases, with the default tolerance of each (`kpt.tolerance`; a "
              "backend that declares float64, as the reference does, is also judged in it):", "",
              "| dtype | rel_norm | atol | rtol | why |", "|---|---|---|---|---|",
              *(_tolerance_row(d) for d in dtypes), ""]
    widened = [c for c in cases if c.tolerance_scale != 1.0 or c.eager_factor]
    if widened:
        lines += ["**Widened cases** (ill-conditioned: float32 arithmetic itself errs beyond the table):", ""]
        for c in widened:
            how = [f"tolerance × {c.tolerance_scale:g}"] if c.tolerance_scale != 1.0 else []
            how += [f"within {c.eager_factor:g}× the error of eager in the dtype under test"] if c.eager_factor else []
            lines.append(f"- `{c.name}`: {'; '.join(how)}" + (f" — {c.description}" if c.description else ""))
        lines.append("")
    lines += [f"**Conformance cases**: {len(cases)} (" + ", ".join(f"`{c.name}`" for c in cases) + ").", ""]
    bad = spec.bad_inputs()
    if bad:
        lines += ["**Errors** — each invalid call below must raise the error named:", "",
                  "| invalid call | raises |", "|---|---|",
                  *(f"| `{b.name}` | `{b.error.__name__}` |" for b in bad), ""]
    values = spec.bad_indices()
    if values:
        lines += ["**Index values** out of range (checked under `kpt.checking_indices()`, which raises "
                  "`KernelInputError` naming the argument; otherwise the kernel's defined result):", "",
                  *(f"- `{v.name}` (argument `{v.arg}`)" for v in values), ""]
    return "\n".join(lines)


def reference() -> str:
    return "\n".join(_section(spec) for spec in kpt.SPECS.values())


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the markers: the kernel sections (reference/kernels.md) and the tolerance table (any page)."""
    if page.file.src_uri == "reference/kernels.md" and MARKER not in markdown:
        raise ValueError(f"reference/kernels.md lost its marker {MARKER!r}")
    return markdown.replace(TOLERANCE_MARKER, tolerance_table()).replace(MARKER, reference())
