"""Live progress of a training run: one bar over iterations with the rollout success rate,
generated tokens per second and the ETA (rich).

On a terminal the bar stays at the bottom while the per-iteration log lines scroll above it
(rich redirects ``print``); when the output is a file or a pipe nothing is redrawn and only the
log lines are written, so logs stay readable.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["IterationProgress"]


class IterationProgress:
    """``with IterationProgress(total, done) as bar: ...; bar.update(success, tokens_per_s)``."""

    def __init__(self, total: int, done: int = 0, console: Console | None = None) -> None:
        self.console = console or Console()
        self._progress = Progress(
            TextColumn("[bold]iteration"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("success {task.fields[success]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self._task = self._progress.add_task(
            "rl", total=total, completed=done, success="-", tps="-"
        )

    def __enter__(self) -> IterationProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def update(self, success: float, tokens_per_s: float) -> None:
        """One iteration finished."""
        self._progress.update(
            self._task, advance=1, success=f"{success:.3f}", tps=f"{tokens_per_s:.0f}"
        )
