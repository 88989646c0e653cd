"""`kpt check`'s progress bar: a pytest plugin drawing one rich bar over the collected tests
(with the optional extra ``kpt-core[cli]``; without rich, pytest's own percentage is the progress)."""

from __future__ import annotations

from typing import Any


class RichProgress:
    """Advances one bar per finished test; failures counted in its description."""

    def __init__(self) -> None:
        import rich.progress

        self.bar = rich.progress.Progress(
            rich.progress.TextColumn("{task.description}"), rich.progress.BarColumn(),
            rich.progress.MofNCompleteColumn(), rich.progress.TimeElapsedColumn(), transient=False)
        self.task: Any = None
        self.failed = 0

    def pytest_collection_finish(self, session: Any) -> None:
        self.task = self.bar.add_task("kpt check", total=len(session.items))
        self.bar.start()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed and report.when == "call":
            self.failed += 1
        if report.when == "teardown" and self.task is not None:
            description = f"kpt check ({self.failed} failed)" if self.failed else "kpt check"
            self.bar.update(self.task, advance=1, description=description)

    def pytest_sessionfinish(self) -> None:
        self.bar.stop()


def progress_plugins() -> tuple[object, ...]:
    """The progress plugin when rich is installed, else none."""
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return ()
    return (RichProgress(),)
