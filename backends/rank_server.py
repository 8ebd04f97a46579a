"""The forkserver the launcher starts its rank processes from (backends/processes.py).

It imports torch and the rank's code once, so that each rank is a fork of a process that
has them already; those imports take seconds, so the server starts as early as a run
knows it will need one, before the launcher imports torch itself: `pipelang run` starts
it right after compiling the schedule (pipelang/cli/run.py), and the two imports overlap.
This module imports no torch for that reason.
"""

from __future__ import annotations

import multiprocessing as mp
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
