"""The committed results, one file per device, and the tables written from them.

    python scripts/results_table.py                      # benchmarks/<device>.md and README.md's tables
    python scripts/results_table.py --check              # exit 1 when any of them is out of date
    python scripts/results_table.py --record h100 reports/bench-cuda/bench.json   # a new run in

``benchmarks/<device>.json`` (schema 1) holds the latest result of each kind on that device: the
``bench.json`` of each `kpt bench` sweep and timing (``bench``), ``scripts/train_llama.py``'s
results (``train``) and ``scripts/train_distributed.py``'s (``distributed``), each with the commit
of kpt it was measured on. ``--record`` replaces the run of the same sweep and timing (or kind)
with the file given, stamped with the current commit. The tables are never edited by hand: the
README's sits between ``<!-- results:<device> -->`` and ``<!-- /results:<device> -->``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
README = ROOT / "README.md"
SCHEMA_VERSION = 1


def load(device: str) -> dict:
    path = BENCHMARKS / f"{device}.json"
    if not path.is_file():
        sys.exit(f"results_table: no {path.relative_to(ROOT)} (devices: {', '.join(devices()) or 'none'})")
    data = json.loads(path.read_text())
    if data.get("schema_version") != SCHEMA_VERSION:
        sys.exit(f"results_table: {path.name} has schema {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    return data


def devices() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.json"))


def ratios(result: dict) -> list[float]:
    """Each timing's ratio to the fastest peer (eager, compile, the libraries): above 1, kpt is faster."""
    out = []
    for row in result["results"]:
        ms, peers = row.get("ms") or {}, peer_ms(row)
        if ms.get("backend") and peers and not row.get("wrong") and not row.get("skipped"):
            out.append(min(peers.values()) / ms["backend"])
    return out


def peer_ms(row: dict) -> dict[str, float]:
    """A timing's peers by name (eager, compile, each library; "library" where only the fastest was
    kept) and their milliseconds."""
    ms = row.get("ms") or {}
    peers = {k: v for k, v in ms.items() if k not in ("backend", "library") and v}
    peers |= {k: v for k, v in (row.get("libraries") or {}).items() if v}
    if not peers and ms.get("library"):
        peers["library"] = ms["library"]
    return peers


def bench_rows(data: dict) -> list[str]:
    """One row per kernel of each bench run: its timings, median and worst ratio to the best peer."""
    rows = []
    for run in (r for r in data["runs"] if r["kind"] == "bench"):
        result = run["result"]
        for kernel, worst in result["worst"].items():
            mine = {**result, "results": [r for r in result["results"] if r["kernel"] == kernel]}
            if worst["ratio"] is None:  # nothing timed: every shape skipped or wrong
                cells = f"– | – ({worst.get('skipped', 0)} skipped, {worst['wrong']} wrong)"
            else:
                cells = (f"{statistics.median(ratios(mine)):.2f}× | {worst['ratio']:.3f}× ({worst['mode']}, "
                         f"{worst['case']}, against {worst['peer']})")
            rows.append(
                f"| {kernel} | {result['sweep']} ({result['timing']}) | {worst['timings']} | {cells} | "
                f"{result['timestamp'][:10]}, `{run['commit'][:8]}` |"
            )
    return rows


def readme_table(device: str, data: dict) -> str:
    head = (
        "| kernel | sweep (timing) | timings | median × best | worst × best (where, against) "
        "| measured, recorded with |\n"
        "|---|---|---|---|---|---|"
    )
    return "\n".join([head, *bench_rows(data)])


def train_table(run: dict) -> list[str]:
    rows = ["| run | tokens/s | peak memory | final loss |", "|---|---|---|---|"]
    for r in run["result"]:
        rows.append(
            f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {r['peak_memory_gib']:.2f} GiB | {r['loss'][-1]:.4f} |"
        )
    return rows


def distributed_table(run: dict) -> list[str]:
    rows = [
        "| plan | implementation | tokens/s | peak GiB per GPU | max loss difference to one GPU |",
        "|---|---|---|---|---|",
    ]
    for part in run["result"]:
        for r in part["runs"]:
            memory = r["peak_memory_gib"]
            memory = " / ".join(f"{m:.2f}" for m in memory) if isinstance(memory, list) else f"{memory:.2f}"
            impl = "kpt.patch" if r["swap"].startswith("kpt.patch") else r["impl"]
            rows.append(
                f"| {r['plan']} | {impl} | {r['tokens_per_s']:,.0f} | {memory} | "
                f"{r['max_loss_diff_vs_single_hf']:.1e} |"
            )
    return rows


def device_page(device: str, data: dict) -> str:
    """benchmarks/<device>.md: every run of the device, its provenance and its tables."""
    out = [
        f"# Results on {data['device']}",
        "",
        f"Written by `python scripts/results_table.py` from `{device}.json`; do not edit by hand.",
        "",
    ]
    for run in data["runs"]:
        result = run["result"]
        out += [
            f"## {run['kind']}: {run['title']}",
            "",
            f"recorded with commit `{run['commit'][:12]}`: {run['note']}",
            "",
        ]
        if run["kind"] == "bench":
            env = result["environment"]
            out += [
                f"`{run['command']}` on {env.get('device')}, torch {env.get('torch')}, triton "
                f"{env.get('triton')}, {result['timestamp']}: {result['timings']} timings, "
                f"{result['wall_s']:.0f} s.",
                "",
            ]
            ceilings = result.get("ceilings") or {}
            if ceilings:
                out += [
                    f"Ceilings measured in that run: copy {ceilings['copy_gbps']:.0f} GB/s, matmul "
                    f"{ceilings['matmul_tflops']:.0f} TFLOP/s. Of ceiling: the kernel's bytes or FLOPs a second "
                    "over the one of them that bounds it. Spread: (slowest − fastest) / median of the rounds.",
                    "",
                ]
            out += [
                "| kernel | case | dtype | mode | kpt ms | best peer ms (which) | × best | spread kpt / peer "
                "| GB/s | TFLOP/s | of ceiling |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for row in result["results"]:
                ms, peers = row.get("ms") or {}, peer_ms(row)
                if not ms.get("backend") or not peers:
                    continue
                best = min(peers, key=peers.__getitem__)
                spread = row.get("spread") or {}
                spreads = " / ".join(f"{spread[k]:.0%}" if k in spread else "–" for k in ("backend", best))
                fraction = row.get("ceiling_fraction")
                roof = f"{fraction:.0%} ({row.get('bound', '')})" if fraction is not None else "–"
                out.append(
                    f"| {row['kernel']} | {row['case']} | {row['dtype']} | {row['mode']} | {ms['backend']:.4g} | "
                    f"{peers[best]:.4g} ({best}) | {peers[best] / ms['backend']:.2f} | {spreads} "
                    f"| {row.get('gbps', 0):.0f} | {row.get('tflops', 0):.1f} | {roof} |"
                )
        elif run["kind"] == "train":
            out += [f"`{run['command']}`", "", *train_table(run)]
        elif run["kind"] == "distributed":
            out += [f"`{run['command']}`", "", *distributed_table(run)]
        out.append("")
    return "\n".join(out)


def with_readme_table(text: str, device: str, table: str) -> str:
    start, end = f"<!-- results:{device} -->", f"<!-- /results:{device} -->"
    if start not in text:
        return text
    before, _, rest = text.partition(start)
    _, _, after = rest.partition(end)
    return f"{before}{start}\n{table}\n{end}{after}"


def outputs() -> dict[Path, str]:
    """Every generated file and the text it should hold."""
    readme = README.read_text()
    out = {}
    for device in devices():
        data = load(device)
        out[BENCHMARKS / f"{device}.md"] = device_page(device, data)
        readme = with_readme_table(readme, device, readme_table(device, data))
    out[README] = readme
    return out


def record(device: str, path: Path) -> None:
    """Put the bench.json at ``path`` into benchmarks/<device>.json in place of its sweep and timing's."""
    result = json.loads(path.read_text())
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    target = BENCHMARKS / f"{device}.json"
    data = load(device) if target.is_file() else {"schema_version": SCHEMA_VERSION, "device": device, "runs": []}
    key = (result.get("sweep"), result.get("timing"))
    data["runs"] = [
        r for r in data["runs"] if r["kind"] != "bench" or (r["result"].get("sweep"), r["result"].get("timing")) != key
    ]
    data["runs"].append(
        {
            "kind": "bench",
            "title": f"sweep {key[0]}, {key[1]}",
            "commit": commit,
            "command": f"kpt bench --backend {result['backend']} --sweep {key[0]}",
            "note": "",
            "result": result,
        }
    )
    target.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated file is out of date")
    parser.add_argument("--record", nargs=2, metavar=("DEVICE", "BENCH_JSON"), help="put a kpt bench run in")
    args = parser.parse_args(argv)
    if args.record:
        device, path = args.record
        if not Path(path).is_file():
            sys.exit(f"results_table: no such file: {path}")
        record(device, Path(path))
    stale = {path: text for path, text in outputs().items() if not path.is_file() or path.read_text() != text}
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python scripts/results_table.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in stale.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
