"""The README's Python snippets run as written on a CPU machine, each in a fresh process with no
kpt variables set, as a newcomer would paste them. A snippet that is a fragment of a package says
so in an HTML comment just above it (``<!-- not run: why -->``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPET = re.compile(r"^(?P<indent> *)(?:<!-- not run: (?P<why>.+?) -->\n(?P=indent))?"
                     r"```python\n(?P<code>.*?)^(?P=indent)```", re.M | re.S)


def snippets() -> list[tuple[str, str | None]]:
    """Every ``python`` block of the README: its code (dedented) and why it is not run, if so."""
    return [(textwrap.dedent(m["code"]), m["why"]) for m in SNIPPET.finditer(README.read_text())]


def run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_") and k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


RUNNABLE = [code for code, why in snippets() if why is None]


def test_the_readme_has_snippets_and_says_why_one_is_not_run() -> None:
    assert len(RUNNABLE) >= 2
    assert [why for _, why in snippets() if why] == [
        "needs a Mac with Apple silicon", "a module of a backend package; examples/kpt-example is the runnable one"]


@pytest.mark.parametrize("code", RUNNABLE, ids=lambda code: code.splitlines()[-1][:40])
def test_snippet_runs_as_written(code: str, tmp_path: Path) -> None:
    done = run(code, tmp_path)
    assert done.returncode == 0, f"README snippet failed:\n{code}\n{done.stderr[-4000:]}"


def test_fpga_sim_configure_line_configures(tmp_path: Path) -> None:
    code = next(c for c in RUNNABLE if "kpt_fpga_sim.configure" in c)
    assert "ap_fixed<16,6,AP_RND,AP_SAT> on u280 at 250 MHz" in run(code, tmp_path).stdout
