"""Start one process per rank on this machine, watch them, stop them all on a fault.

The launcher hosts the rendezvous store (no port race), hands each rank the program (and
where the ranks run one, the checked stream program's text), keeps their logs in a run
folder, and starts the ranks from a forkserver that has torch already imported. Each
rank publishes (phase, step, action) in a shared array and sends its steps, result or
error through a queue. The launcher stops every rank as soon as one fails or dies, or
when no rank has moved for `--timeout` seconds, and names the rank and the action it was
on. Ranks also die with the launcher (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import os
import queue as queue_module
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipelang.backends.backend import BACKENDS, runs_streams
from pipelang.backends.config import RunConfig
from pipelang.backends.mesh import Grid
from pipelang.backends.metrics import StepMetrics, StepReport, combine
from pipelang.backends.models import Shapes
from pipelang.backends.rank_base import RankResult
from pipelang.backends.rank_server import forkserver, main_module_hidden
from pipelang.backends.report import Outcome
from pipelang.backends.termination import passing_sigterm
from pipelang.backends.trace_steps import step_events
from pipelang.backends.worker import (
    PHASE_DONE,
    PHASE_FAILED,
    PHASE_SETUP,
    PHASE_STARTING,
    Job,
    OnStep,
    from_bytes,
    rank_threads,
    worker_main,
)
from pipelang.diagnostics import InternalError
from pipelang.ir import Program
from pipelang.ir.streams import StreamProgram

GRACE_SECONDS = 0.5
"""After a first failure, how long to keep listening for the one that caused it."""
HANG_MARGIN = 2.0
"""The launcher calls a run hung this long after the ranks' own communication timeout,
so that a rank blocked on a silent peer reports first and the silent one gets the blame."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a rank stopped; `secondary` when it only saw another rank go away."""

    rank: int
    step: int
    action: int
    phase: int
    what: str
    traceback: str = ""
    secondary: bool = False


class RunFailure(Exception):
    """A run that stopped because a rank failed, died or hung; the message says which."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def where(
    labels: Sequence[Sequence[str]], rank: int, phase: int, step: int, action: int, tp: int = 1
) -> str:
    """`at step 1, action 7 (recv:B0@2/main<3)`, or `during setup`.

    `labels[r]` names the ops program rank r runs (`action_labels`); `rank` is
    the process's rank, and with `--dp` and `--tp T` it runs program rank
    `rank // T % R` (backends/mesh.py)."""
    if phase in (PHASE_STARTING, PHASE_SETUP) or step < 0:
        return "during setup"
    lines = labels[rank // tp % len(labels)]
    if phase == PHASE_DONE or action >= len(lines):
        return f"after step {step}"
    return f"at step {step}, action {action} `{lines[action]}`"


def action_labels(
    program: Program, streams: StreamProgram | None = None, cuda: bool = False
) -> list[list[str]]:
    """What each op each program rank runs does: its action's token, or with a stream
    program its op (`r1.recv0 recv:F0@0/main<0`): every op on a GPU, those the host
    issues on a CPU (as `executor.stream_rank` runs them)."""
    if streams is None:
        return [[a.text() for a in actions] for actions in program.ranks]
    return [
        [
            f"{op.stream_name} {op.what if op.event is None else f'{op.what} e{op.event}'}"
            for _, op in (streams.by_rank(r) if cuda else streams.host_ops(r))
        ]
        for r in range(program.num_ranks)
    ]


class Launcher:
    """Runs the ranks of one Program as processes; `run()` returns or raises RunFailure."""

    def __init__(
        self,
        program: Program,
        config: RunConfig,
        shapes: Shapes,
        on_step: OnStep,
        streams: StreamProgram | None = None,
    ) -> None:
        self.program = program
        self.config = config
        self.shapes = shapes
        self.on_step = on_step
        self.world = Grid(config.dp, program.num_ranks, config.tp).world
        if (streams is not None) != runs_streams(program, config):
            raise InternalError("the launcher takes the stream program exactly where it runs")
        self.streams = streams
        """The checked stream program the ranks run (`backend.runs_streams`), or None."""
        self.cuda = BACKENDS[config.backend].cuda
        self.labels = action_labels(program, self.streams, self.cuda)
        self.ctx = forkserver()
        self.status: Any = self.ctx.Array("q", 3 * self.world + 1, lock=False)
        """Per rank (phase, step, action); last, whether SIGTERM asked the run to stop."""
        self.queue: Any = self.ctx.Queue()
        self.procs: list[Any] = []
        self.results: dict[int, RankResult] = {}
        self.step_reports: dict[int, dict[int, StepReport]] = {}
        """Per step not yet combined, the reports of the ranks that finished it."""
        self.losses: list[float] = []
        self.metrics: list[StepMetrics] = []
        self.failures: list[Failure] = []

    def run(self) -> Outcome:
        with tempfile.TemporaryDirectory(prefix="pipelang-run-") as run_dir:
            self.run_dir = Path(run_dir)
            streams = None if self.streams is None else self.streams.dump()
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                None,
                True,
                wait_for_workers=False,
                timeout=timedelta(seconds=self.config.timeout),
            )
            threads = rank_threads(self.world)
            for rank in range(self.world):
                job = Job(
                    self.program.to_json(),
                    self.config,
                    rank,
                    "127.0.0.1",
                    store.port,
                    run_dir,
                    threads,
                    self.shapes,
                    dict(os.environ),
                    streams,
                )
                proc = self.ctx.Process(
                    target=worker_main,
                    args=(job, self.status, self.queue),
                    name=f"pipelang-rank{rank}",
                    daemon=True,
                )
                self.procs.append(proc)
            try:
                with main_module_hidden():
                    for proc in self.procs:
                        proc.start()
                with passing_sigterm(self.status):
                    self._watch()
            finally:
                # Interrupted (Ctrl-C): the ranks are stopped at once; else finished ranks
                # get a moment to exit (and ranks stopping at a step, to save).
                self._stop_all(graceful=not isinstance(sys.exc_info()[1], KeyboardInterrupt))
            if self.failures:
                raise self._failure_report()
        return Outcome([self.results[r] for r in range(self.world)], self.losses, self.metrics)

    def _watch(self) -> None:
        last_seen: tuple[int, ...] = tuple(self.status)
        last_change = time.monotonic()
        first_failure: float | None = None
        while len(self.results) < self.world:
            self._drain(timeout=0.05)
            self._check_exits()
            now = time.monotonic()
            if self.failures:
                first_failure = first_failure or now
                if now - first_failure >= GRACE_SECONDS or self._primary() is not None:
                    return
                continue
            seen = tuple(self.status)
            if seen != last_seen:
                last_seen, last_change = seen, now
            elif now - last_change > self.config.timeout + HANG_MARGIN:
                self._hung()
                return

    def _drain(self, timeout: float) -> None:
        try:
            message = self.queue.get(timeout=timeout)
        except queue_module.Empty:
            return
        while True:
            self._handle(message)
            try:
                message = self.queue.get_nowait()
            except queue_module.Empty:
                return

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, rank = message[0], message[1]
        if kind == "step":
            _, _, step, report = message
            self._step_done(rank, step, report)
        elif kind == "done":
            self.results[rank] = from_bytes(message[2])
        elif kind == "note":  # a line a rank says (a checkpoint complete)
            print(message[2], file=sys.stderr, flush=True)
        elif kind == "error":
            _, _, what, trace, secondary = message
            phase, step, action = self._status(rank)
            self.failures.append(Failure(rank, step, action, phase, what, trace, secondary))

    def _status(self, rank: int) -> tuple[int, int, int]:
        slot = 3 * rank
        return self.status[slot], self.status[slot + 1], self.status[slot + 2]

    def _step_done(self, rank: int, step: int, report: StepReport) -> None:
        self.step_reports.setdefault(step, {})[rank] = report
        while len(self.step_reports.get(len(self.losses), {})) == self.world:
            done = len(self.losses)
            reports = self.step_reports.pop(done)
            n = self.program.num_microbatches * self.config.dp
            loss, seconds, metrics = combine([reports[r] for r in range(self.world)], n)
            self.losses.append(loss)
            self.metrics.append(metrics)
            events = step_events([reports[r] for r in range(self.world)])
            self.on_step(done, loss, seconds, metrics, events)

    def _check_exits(self) -> None:
        reported = {f.rank for f in self.failures}
        for rank, proc in enumerate(self.procs):
            code = proc.exitcode
            if code is None or rank in reported or (code == 0 and rank in self.results):
                continue
            self._drain(timeout=0.2)  # its own error or result may still be in the pipe
            if rank in {f.rank for f in self.failures} or (code == 0 and rank in self.results):
                continue
            phase, step, action = self._status(rank)
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            what = f"the process died ({how})"
            if code == 0:  # os._exit(0) in a model's code, say: not a finished rank
                what = "the process ended (exit status 0) before it finished its steps"
            self.failures.append(Failure(rank, step, action, phase, what))

    def _hung(self) -> None:
        for rank in range(self.world):
            phase, step, action = self._status(rank)
            if phase not in (PHASE_DONE, PHASE_FAILED):
                what = f"no progress for {self.config.timeout:g} s (--timeout)"
                self.failures.append(Failure(rank, step, action, phase, what))

    def _primary(self) -> Failure | None:
        for failure in self.failures:
            if not failure.secondary:
                return failure
        return None

    def _where(self, rank: int, phase: int, step: int, action: int) -> str:
        """`where` process `rank` was (its program rank's action)."""
        return where(self.labels, rank, phase, step, action, self.config.tp)

    def _failure_report(self) -> RunFailure:
        primary = self._primary()
        if primary is None:
            return self._silent_rank_report()
        if all(f.what.startswith("no progress") for f in self.failures):
            lines = [
                f"rank {f.rank} {self._where(f.rank, f.phase, f.step, f.action)}"
                for f in self.failures
            ]
            return RunFailure(
                "the run hung: no rank made progress for "
                f"{self.config.timeout:g} s (--timeout); waiting:\n  " + "\n  ".join(lines)
            )
        place = self._where(primary.rank, primary.phase, primary.step, primary.action)
        others = [r for r in range(self.world) if r != primary.rank]
        message = f"rank {primary.rank} failed {place}: {primary.what}"
        if others:
            message += f"\nstopped the other ranks ({', '.join(map(str, others))})"
        details = primary.traceback + self._logs()
        return RunFailure(message, details)

    def _silent_rank_report(self) -> RunFailure:
        """Every failure seen is a rank giving up on a peer: blame the ranks that went
        quiet (hung) rather than those that timed out waiting for them."""
        failed = {f.rank for f in self.failures}
        quiet = []
        for rank in range(self.world):
            phase, step, action = self._status(rank)
            if rank not in failed and phase not in (PHASE_DONE, PHASE_FAILED):
                quiet.append(
                    f"rank {rank} stopped responding {self._where(rank, phase, step, action)}"
                )
        first = self.failures[0]
        if not quiet:
            lines = [
                f"rank {f.rank} {self._where(f.rank, f.phase, f.step, f.action)}: {f.what}"
                for f in sorted(self.failures, key=lambda f: f.rank)
            ]
            return RunFailure(
                "every rank gave up waiting for another (--timeout "
                f"{self.config.timeout:g} s):\n  " + "\n  ".join(lines),
                first.traceback + self._logs(),
            )
        waited = ", ".join(str(r) for r in sorted(failed))
        return RunFailure(
            "\n".join(quiet) + f"\nranks {waited} timed out waiting for it "
            f"(--timeout {self.config.timeout:g} s); stopped every rank",
            first.traceback + self._logs(),
        )

    def _logs(self) -> str:
        parts = []
        for rank in range(self.world):
            path = self.run_dir / f"rank{rank}.log"
            text = path.read_text(errors="replace").strip() if path.exists() else ""
            if text:
                parts.append(f"--- rank {rank} log ---\n{text[-4000:]}")
        return "\n" + "\n".join(parts) if parts else ""

    def _stop_all(self, graceful: bool) -> None:
        """Let finished ranks exit (`graceful`, and none failed); kill whatever is left (a
        rank takes SIGTERM as a request to stop at its next step,
        backends/termination.py)."""
        if graceful and not self.failures:
            deadline = time.monotonic() + 5.0
            for proc in self.procs:
                if proc.pid is not None:
                    proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
                proc.join()


def launch(
    program: Program,
    config: RunConfig,
    shapes: Shapes,
    on_step: OnStep,
    streams: StreamProgram | None = None,
) -> Outcome:
    """Run `program` with one process per rank on this machine: each rank its part of
    `streams` where the ranks run stream programs (`backend.runs_streams`; the caller
    compiles it, `compiler.stream_program`), else its action list."""
    return Launcher(program, config, shapes, on_step, streams).run()
