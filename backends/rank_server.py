"""The forkserver the launcher starts its rank processes from (backends/processes.py).

It imports torch and the rank's code once, so that each rank is a fork of a process that
has them already; those imports take seconds, so the server starts as early as a run
knows it will need one, before the launcher imports torch itself: `pipelang run` starts
it right after compiling the schedule (pipelang/cli/run.py), and the two imports overlap.
This module imports no torch for that reason.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
from collections.abc import Callable, Iterator
from typing import Any


def forkserver() -> Any:
    """The multiprocessing context ranks start from, its server started (once per
    process: later calls return at once)."""
    ctx = mp.get_context("forkserver")
    # symbolic_shapes: autograd imports it (and sympy) on the first backward with a
    # gradient tensor; loading it once here saves every rank most of a second.
    ctx.set_forkserver_preload(
        [
            "pipelang.backends.forkserver_guard",  # the server dies with this process
            "pipelang.backends.worker",
            "torch.fx.experimental.symbolic_shapes",
        ]
    )
    from multiprocessing import forkserver as server

    server.ensure_running()
    return ctx


def start(target: Callable[..., None], args: tuple[Any, ...], name: str) -> Any:
    """A daemon process forked from the server, running `target(*args)`, started; it gets
    this process's working directory and `sys.path` (multiprocessing sends them), not its
    environment variables (the server's are from when it started)."""
    proc = forkserver().Process(target=target, args=args, name=name, daemon=True)
    with main_module_hidden():
        proc.start()
    return proc


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start processes without re-running the caller's `__main__` in them.

    multiprocessing re-imports the parent's main script in every child (as `__mp_main__`);
    a rank (or a model's vetting) needs nothing from it, and a script without an
    `if __name__ == "__main__"` guard would launch again from each child (stdin and
    notebooks cannot be re-imported at all). So the main module's file and spec are
    hidden while they start.
    """
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
