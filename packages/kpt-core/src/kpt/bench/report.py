"""The report of a run: each kernel's worst ratio against its best peer, and the Markdown table.

`worst` summarizes a sweep's `Measurement`s per kernel, `markdown` writes ``bench.md`` (`row` is
one timing as a line of `HEADER`'s table); `SCHEMA_VERSION` is the version of ``bench.json``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .host import HostCost
from .measure import Measurement
from .peers import PEERS
from .timing import Ceilings

SCHEMA_VERSION = 1
"""Of ``bench.json``: ``schema_version``, ``backend``, then what `kpt.overview.provenance` records
(``versions``, ``device``, ``machine``, ``timestamp``), then the run's ``environment`` (the backend's
facts), ``ceilings``, ``sweep``, ``timing`` ("calls", or "CUDA-graph replays" with ``--graphs``) and its
results."""


def worst(results: Iterable[Measurement]) -> dict[str, dict[str, Any]]:
    """Per kernel: the shape and mode where it does worst against its best peer (the ratio: the
    peer's time over the backend's, and ``spread``: the backend's and that peer's round spreads
    there, `Measurement.spread`), how many timings it had, and how many were wrong or failed."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        s = out.setdefault(r.kernel, {"timings": 0, "wrong": 0, "ratio": None, "case": "", "mode": "", "peer": "",
                                      "spread": None, "seconds": 0.0})
        s["timings"] += 1
        s["seconds"] += r.seconds
        if r.skipped:
            s["skipped"] = s.get("skipped", 0) + 1
            continue
        if r.wrong:
            s["wrong"] += 1
            continue
        best = r.best_peer()
        if best is not None and (s["ratio"] is None or best[1] < s["ratio"]):
            spread = (r.spread["backend"], r.spread[best[0]]) if {"backend", best[0]} <= r.spread.keys() else None
            s.update(ratio=best[1], case=r.case, mode=r.mode, peer=best[0], spread=spread)
    return out


def _spread(value: tuple[float, float] | None) -> str:
    return "–" if value is None else f"{value[0]:.1%} / {value[1]:.1%}"


def _ms(r: Measurement, key: str) -> str:
    if key == "library" and "library" not in r.ms:
        return r.library or "–"
    if key not in r.ms:
        return "–"
    return f"{r.ms[key]:.4f}" + (f" ({r.library})" if key == "library" else "")


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


HEADER = ("| kernel | shape | dtype | mode | kpt ms | eager ms | compile ms | library ms | × eager | × compile "
          "| × library | × best | GB/s | TFLOP/s | of ceiling |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(r: Measurement) -> str:
    """One measurement as a row of `HEADER`'s table (× peer: the peer's time over kpt's)."""
    if r.wrong or r.skipped:
        what = f"WRONG: {r.wrong}" if r.wrong else f"SKIPPED: {r.skipped}"
        return f"| {r.kernel} | {r.case} | {r.dtype} | {r.mode} | {what} |||||||||| "
    best = r.best_peer()
    ms = " | ".join(_ms(r, k) for k in ("backend", *PEERS))
    ratios = " | ".join(_ratio(r.speedup(k)) for k in PEERS)
    return (f"| {r.kernel} | {r.case} | {r.dtype} | {r.mode} | {ms} | {ratios} | {_ratio(best and best[1])} "
            f"| {r.gbps:.0f} | {r.tflops:.1f} | {r.ceiling_fraction:.0%} ({r.bound}) |")


def markdown(results: list[Measurement], env: dict[str, str], ceilings: Ceilings,
             host: list[HostCost] | None = None, base: dict[str, float | str] | None = None,
             title: str = "") -> str:
    """The report: environment and ceilings, each kernel's worst ratio, the host costs, every row."""
    lines = [title, ""] if title else []
    lines += [
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".",
        f"Ceilings measured in this run: copy {ceilings.copy_gbps:.0f} GB/s, "
        f"matmul {ceilings.matmul_tflops:.0f} TFLOP/s.",
        "Ratios are the peer's time over kpt's: above 1, kpt is faster. × best: against the fastest of "
        "eager, compile and the libraries.", "",
    ]
    summary = worst(results)
    if summary:
        lines += ["| kernel | timings | wrong or failed | skipped | worst × best | at | mode | best peer there "
                  "| round spread there, kpt / peer | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
        for kernel, s in summary.items():
            lines.append(f"| {kernel} | {s['timings']} | {s['wrong']} | {s.get('skipped', 0)} | {_ratio(s['ratio'])} "
                         f"| {s['case'] or '–'} | {s['mode'] or '–'} | {s['peer'] or '–'} | {_spread(s['spread'])} "
                         f"| {s['seconds']:.0f} |")
        lines += ["", "Round spread: how far an implementation's timings in the rounds that take turns lay "
                  "apart, (slowest − fastest) / median; a worst ratio nearer 1 than it is within the run's noise.",
                  ""]
    if host:
        lines += ["Host time of one forward call (µs, wall clock of back-to-back calls) at each kernel's "
                  "smallest shape; baselines: " + ", ".join(
                      f"{k} {v:.1f} µs" if isinstance(v, float) else f"{k}: {v}" for k, v in (base or {}).items())
                  + ".", "",
                  "| kernel | shape | kpt µs | eager µs | libraries µs |", "|---|---|---|---|---|"]
        for c in host:
            libs = ", ".join(f"{k} {v:.1f}" for k, v in c.us.items() if k not in ("backend", "eager"))
            cells = [f"{c.us[k]:.1f}" if k in c.us else c.errors.get(k, "–") for k in ("backend", "eager")]
            lines.append(f"| {c.kernel} | {c.case} | {' | '.join(cells)} | {libs or '–'} |")
        lines.append("")
    lines += [HEADER, *(row(r) for r in results)]
    errors = [(r, k, v) for r in results for k, v in r.errors.items()]
    if errors:
        lines += ["", "Peers left out (an error, or a result that disagreed with eager):", ""]
        lines += [f"- {r.kernel} {r.case} {r.mode}: {k}: {v}" for r, k, v in errors]
    return "\n".join(lines) + "\n"
