"""SIGTERM: what SLURM, Kubernetes and torchrun send before they kill a job.

A run that gets it stops every rank at the next step boundary, writes a checkpoint there
when `--save` is set, and exits 143 (128 + SIGTERM), as a job that ends on this signal
does. The ranks must stop after the same step, or the ones that go on would wait for the
others forever; so after every step each rank says whether it saw the signal, and one
max-allreduce over the run (a single number, order-free and exact) makes that a common
decision. The signal may reach every process (SLURM's `scancel`, a container's stop), one
rank (torchrun forwards it to its workers), or only `pipelang run`'s launcher, which
passes it on through the shared status array (`Launcher`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, MutableSequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only once a run starts: `pipelang run --help` imports this
    import torch

EXIT_STATUS = 128 + signal.SIGTERM
"""What a run stopped by SIGTERM exits with: 143."""


class Termination:
    """Whether this process, or its launcher, was asked to stop; installed on creation."""

    def __init__(self, shared: MutableSequence[int] | None = None, slot: int = -1) -> None:
        self.requested = False
        self.shared = shared
        """The launcher's status array, whose `slot` it sets on its own SIGTERM."""
        self.slot = slot
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any process of the run was asked to stop: a collective, after each step
        on every rank."""
        import torch
        import torch.distributed as dist

        mine = self.requested or (self.shared is not None and self.shared[self.slot] != 0)
        from pipelang.backends.transport import peer_failures

        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
        with peer_failures():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def stopped_line(step: int, save: str | None) -> str:
    """What a run stopped by SIGTERM prints: the step it stopped after and where to go on."""
    line = f"terminated (SIGTERM): every rank stopped after step {step}"
    if save is None:
        return line + "; nothing was saved (no --save)"
    return line + f"; its checkpoint is {save}/step-{step}: go on with --resume {save}"


class Terminated(Exception):
    """SIGTERM where no step boundary can be waited for: a second one to the launcher,
    or one to a `local` run (its ranks are threads of this process)."""


_seen: list[bool] = []
"""Whether a SIGTERM reached `passing_sigterm`: later ones find this process stopping."""
_raised: list[bool] = []
"""Whether `Terminated` was raised."""


@contextlib.contextmanager
def passing_sigterm(status: MutableSequence[int] | None) -> Iterator[None]:
    """While ranks run, SIGTERM to this process asks them to stop at their next step
    (the last slot of the launcher's status array, read by `Termination`); a second one,
    or any with no ranks to ask (`status` None), raises `Terminated` here at once; any
    after that is ignored, to the end of the process (it is on its way to exit 143)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take signals
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if status is not None and not status[len(status) - 1]:
            status[len(status) - 1] = 1  # the ranks stop at their next step
            _seen.append(True)
            return
        if _raised or (status is None and _seen):  # this process is stopping (exit 143)
            return
        _raised.append(True)
        _seen.append(True)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:  # once seen, a later SIGTERM cannot kill the process on its way to exit 143
        signal.signal(signal.SIGTERM, signal.SIG_IGN if _seen else previous)


STRANDED: list[threading.Event] = []
"""Of each rank thread of a `local` run that did not stop when asked (`LocalRun`), the
event it sets when it ends."""


def exit_if_stranded(status: int) -> None:
    """End the process now with `status` when a rank thread of a `local` run is still
    running: Python ends a daemon thread that wants the GIL back after exit began with
    `pthread_exit`, and its unwinding through torch's `noexcept` C++ frames (a backward,
    an optimizer step) calls `std::terminate` ("terminate called without an active
    exception", status -6)."""
    if all(done.is_set() for done in STRANDED):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
