"""`kpt check`'s progress bar: a pytest plugin drawing one rich bar over the collected tests
(with the optional extra ``kpt-core[cli]``; without rich, pytest's own dots are the progress).

The bar replaces pytest's dots rather than sharing their line: `progress_plugins` asks pytest to
be quiet (``-q``, no percentages), and the plugin blanks the one-letter status of each test. A
``-v`` given to pytest brings the per-test lines back, and then no bar is drawn.
"""

from __future__ import annotations

from typing import Any

import pytest

QUIET = ("-q", "-o", "console_output_style=classic")
"""pytest options that leave the bar alone on its lines: no file names, no percentages."""


class RichProgress:
    """Advances one bar per finished test; failures counted in its description."""

    def __init__(self) -> None:
        import rich.progress

        self.bar = rich.progress.Progress(
            rich.progress.TextColumn("{task.description}"), rich.progress.BarColumn(),
            rich.progress.MofNCompleteColumn(), rich.progress.TimeElapsedColumn(), transient=False)
        self.task: Any = None
        self.failed = 0
        self.on = True

    def pytest_configure(self, config: pytest.Config) -> None:
        # pytest writes a line per test when verbose: the bar would share it
        self.on = config.get_verbosity() < 0

    @pytest.hookimpl(wrapper=True)
    def pytest_report_teststatus(self, report: Any, config: pytest.Config) -> Any:
        status = yield
        if not self.on or not isinstance(status, tuple):
            return status
        category, _letter, word = status
        return category, "", word  # no dot, F or s: the bar counts the tests

    def pytest_collection_finish(self, session: Any) -> None:
        if self.on:
            self.task = self.bar.add_task("kpt check", total=len(session.items))
            self.bar.start()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed and report.when == "call":
            self.failed += 1
        if report.when == "teardown" and self.task is not None:
            description = f"kpt check ({self.failed} failed)" if self.failed else "kpt check"
            self.bar.update(self.task, advance=1, description=description)

    def pytest_sessionfinish(self) -> None:
        if self.task is not None:
            self.bar.stop()


def progress_plugins() -> tuple[tuple[object, ...], tuple[str, ...]]:
    """The progress plugin and the pytest options it needs when rich is installed, else none."""
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return (), ()
    return (RichProgress(),), QUIET
