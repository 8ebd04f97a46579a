"""A progress bar on stderr for the long commands besides `run` (`profile`, `plan`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

Update = Callable[[str, int, int, str], None]
"""`update(phase, done, total, what)`: `done` of `total` items of `phase`, now `what`."""


@contextmanager
def work_progress(console: Console) -> Iterator[Update]:
    """A bar per phase (shown while the work runs, cleared at the end); yields `update`."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[what]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    tasks: dict[str, TaskID] = {}

    def update(phase: str, done: int, total: int, what: str) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total, what="")
        bar.update(tasks[phase], completed=done, total=total, what=what)

    with bar:
        yield update
