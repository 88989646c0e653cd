"""The roofline picture of a benchmark run: achieved FLOP/s and bytes/s of every kernel against
the ceilings measured in the same run.

    kpt bench --backend cuda --sweep models --plot                       # measure, then draw
    python -m kpt.bench.roofline reports/bench/bench.json roofline.png    # draw a recorded run again

Left: each timing as a point at its arithmetic intensity (FLOPs per byte of the cost model) and
achieved TFLOP/s, under the roof min(matmul rate, intensity × copy bandwidth). Right: each
timing's achieved GB/s against the copy bandwidth, per kernel. Needs matplotlib
(``pip install "kpt-core[bench]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def require_matplotlib() -> None:
    """Exit with how to install matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit('the roofline plot needs matplotlib: pip install "kpt-core[bench]" (or pip install matplotlib)')


def points(report: dict[str, Any]) -> dict[str, list[tuple[float, float, float]]]:
    """Per kernel, (FLOPs per byte, TFLOP/s, GB/s) of each timing that has a speed."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for r in report["results"]:
        if r.get("wrong") or not r.get("nbytes") or "backend" not in r["ms"]:
            continue
        out.setdefault(r["kernel"], []).append((r["flops"] / r["nbytes"], r["tflops"], r["gbps"]))
    return out


def plot(report: dict[str, Any], path: str | Path) -> Path:
    """Draw ``report`` (what ``bench.json`` holds) as a PNG at ``path``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copy = report["ceilings"]["copy_gbps"]
    peak = report["ceilings"]["matmul_tflops"]
    data = points(report)
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5))
    colors = plt.get_cmap("tab20")
    markers = "os^vD<>px*h"
    intensities = [x for pts in data.values() for x, _, _ in pts if x > 0] or [1.0]
    lo, hi = min(min(intensities) / 2, 0.05), max(max(intensities) * 2, 4 * peak * 1e3 / copy)
    ridge = peak * 1e3 / copy  # FLOPs per byte where the two ceilings meet
    left.plot([lo, ridge, hi], [lo * copy / 1e3, peak, peak], color="black", lw=1.5,
              label=f"measured roof: copy {copy:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s")
    for i, (kernel, pts) in enumerate(sorted(data.items())):
        style = {"color": colors(i % 20), "marker": markers[i % len(markers)], "s": 22, "alpha": 0.8}
        left.scatter([max(x, lo) for x, _, _ in pts], [max(t, 1e-4) for _, t, _ in pts], label=kernel, **style)
        right.scatter([i] * len(pts), [g for _, _, g in pts], **style)
    left.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOPs per byte of the cost model)",
             ylabel="achieved TFLOP/s", title="roofline")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7, ncol=2, loc="lower right")
    names = sorted(data)
    right.axhline(copy, color="black", lw=1.5, label=f"copy {copy:.0f} GB/s")
    right.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    right.set(ylabel="achieved GB/s (cost model bytes)", title="bandwidth per kernel")
    right.grid(True, axis="y", alpha=0.3)
    right.legend(fontsize=8)
    env = report.get("environment", {})
    fig.suptitle(f"kpt, sweep {report.get('sweep', '?')}: {env.get('device', env.get('gpu', ''))} "
                 f"torch {env.get('torch', '?')}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpt.bench.roofline", description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a bench.json written by kpt bench / python -m kpt.bench")
    parser.add_argument("out", nargs="?", default=None, help="the PNG (default: roofline.png beside the report)")
    opts = parser.parse_args(argv)
    report = json.loads(Path(opts.report).read_text())
    out = plot(report, opts.out or Path(opts.report).with_name("roofline.png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
