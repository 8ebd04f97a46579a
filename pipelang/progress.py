"""The consoles every command prints on, and a progress bar on stderr for the long
commands besides `run` (`profile`, `plan`).

Off a terminal (a pipe, a file, a CI log) a console is wide, so that no table is cut or
wrapped into `…`, and bars are not drawn (their lines would be cut, and a log gets one
line per redraw); `run` still prints a line per step.
"""

from __future__ import annotations

import os
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

OFF_TERMINAL_WIDTH = 200
"""The width of a console that writes to no terminal (unless COLUMNS says otherwise)."""


def console(stderr: bool = False) -> Console:
    """A console for tables and lines: no highlighting, long lines kept whole; off a
    terminal, `OFF_TERMINAL_WIDTH` wide."""
    out = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = OFF_TERMINAL_WIDTH
    return out


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
        disable=not console.is_terminal,
    )
    tasks: dict[str, TaskID] = {}

    def update(phase: str, done: int, total: int, what: str) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total, what="")
        bar.update(tasks[phase], completed=done, total=total, what=what)

    with bar:
        yield update
