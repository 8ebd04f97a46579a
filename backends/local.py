"""The `local` backend: every rank of a program in this one process.

Each rank runs its action list (backends/executor.py) in a thread of its own, and a
`LocalHub` lets one thread run at a time, handing the baton on in rank order whenever a
rank must wait for a message, so a run is deterministic. On the CPU that runs the ranks
one after another. On CUDA every rank computes on its own stream and messages are device
copies ordered by events, so the ranks' kernels overlap on one GPU.
"""

from __future__ import annotations

import threading
import time
import traceback

import torch

from pipelang.backends.config import RunConfig
from pipelang.backends.metrics import StepMetrics, StepReport, combine
from pipelang.backends.models import Shapes
from pipelang.backends.processes import RunFailure, action_labels, where
from pipelang.backends.rank_base import RankResult
from pipelang.backends.report import Outcome
from pipelang.backends.termination import STRANDED
from pipelang.backends.trace_steps import step_events
from pipelang.backends.transport import Aborted, LocalHub, LocalTransport, PeerFailure
from pipelang.backends.worker import (
    PHASE_DONE,
    PHASE_FAILED,
    PHASE_RUNNING,
    PHASE_SETUP,
    OnStep,
    build_rank,
    describe,
    run_step,
)
from pipelang.ir import Program

STOP_SECONDS = 5.0
"""How long a run that stops early (SIGTERM, Ctrl-C, --timeout) waits for its rank threads
to finish the action they are on."""


def local_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


class LocalRun:
    """The threads of one local run and what they report."""

    def __init__(
        self, program: Program, config: RunConfig, shapes: Shapes, on_step: OnStep
    ) -> None:
        self.program = program
        self.shapes = shapes
        self.config = config
        self.on_step = on_step
        self.device = local_device()
        self.world = program.num_ranks * config.dp
        self.hub = LocalHub(program, self.device, config.dp)
        self.labels = action_labels(program)
        self.status = [0] * (3 * self.world)
        self.lock = threading.Lock()
        self.results: dict[int, RankResult] = {}
        self.pending: dict[int, dict[int, StepReport]] = {}
        """Per step not yet combined, the reports of the ranks that finished it."""
        self.losses: list[float] = []
        self.metrics: list[StepMetrics] = []
        self.failure: tuple[int, str, str] | None = None
        self.stopping = threading.Event()
        """Set when the run stops early: every rank thread stops before its next step."""
        self.ended = [threading.Event() for _ in range(self.world)]
        """Set by each rank thread as it ends (whatever `Thread.is_alive` says)."""
        self.t0 = time.perf_counter_ns()
        self.t0_event: torch.cuda.Event | None = None
        if self.device.type == "cuda":
            self.t0_event = torch.cuda.Event(enable_timing=True)
            self.t0_event.record()

    def run(self) -> Outcome:
        threads = [
            threading.Thread(
                target=self._rank_main, args=(r,), name=f"pipelang-rank{r}", daemon=True
            )
            for r in range(self.world)
        ]
        for thread in threads:
            thread.start()
        try:
            self._watch()
        finally:
            self._stop()
        if self.failure is None and self.hub.failure is not None:
            waiting = [
                f"rank {r} {where(self.labels, r, *self.status[3 * r : 3 * r + 3])}"
                for r in range(self.world)
                if self.status[3 * r] == PHASE_FAILED
            ]
            raise RunFailure(f"{self.hub.failure}:\n  " + "\n  ".join(waiting))
        if self.failure is not None:
            rank, what, trace = self.failure
            phase, step, action = self.status[3 * rank : 3 * rank + 3]
            place = where(self.labels, rank, phase, step, action)
            if not trace:  # the watchdog's verdict, not an exception
                raise RunFailure(f"rank {rank} stopped responding {place}: {what}")
            raise RunFailure(f"rank {rank} failed {place}: {what}", trace)
        return Outcome([self.results[r] for r in range(self.world)], self.losses, self.metrics)

    def _watch(self) -> None:
        """Wait for the rank threads, or call the run hung after `--timeout`.

        Never `Thread.join` here: when a signal handler raises (SIGTERM, Ctrl-C) while
        join waits, Python 3.11 marks the thread stopped although it still runs, and
        `_stop` would not wait for it."""
        last, changed = list(self.status), time.monotonic()
        while not all(done.is_set() for done in self.ended):
            time.sleep(0.05)
            if self.status != last:
                last, changed = list(self.status), time.monotonic()
            elif time.monotonic() - changed > self.config.timeout and self.failure is None:
                busy = self.hub.holder  # only the baton holder can be stuck
                self.failure = (busy, f"no progress for {self.config.timeout:g} s (--timeout)", "")
                self.hub.abort(RuntimeError("timeout"))
                return

    def _stop(self) -> None:
        """Stop the rank threads still running (a signal or the watchdog ended the watch)
        and wait for them: a rank waiting for a message raises `Aborted`, a computing one
        stops before its next step. One still running after STOP_SECONDS (stuck inside
        an op) is left in `STRANDED`, and the run ends with `os._exit`
        (`termination.exit_if_stranded`): Python's exit would end it with `pthread_exit`
        inside torch's C++ code, which aborts the process."""
        if all(done.is_set() for done in self.ended):
            return
        self.stopping.set()
        self.hub.abort(RuntimeError("the run was stopped"))
        deadline = time.monotonic() + STOP_SECONDS
        for done in self.ended:
            done.wait(max(0.0, deadline - time.monotonic()))
        STRANDED.extend(done for done in self.ended if not done.is_set())

    def _rank_main(self, rank: int) -> None:
        try:
            self._rank_body(rank)
        finally:
            self.ended[rank].set()

    def _rank_body(self, rank: int) -> None:
        slot = 3 * rank
        self.status[slot] = PHASE_SETUP
        self.status[slot + 1] = -1
        try:
            self.hub.start(rank)
            transport = LocalTransport(self.hub, rank)
            if transport.stream is not None:
                torch.cuda.set_stream(transport.stream)
            program_rank = rank % self.program.num_ranks
            built = build_rank(  # threads run action lists
                self.program,
                program_rank,
                self.config,
                transport,
                self.device,
                self.status,
                shapes=self.shapes,
                replica=rank // self.program.num_ranks,
            )
            runtime = built.runtime
            runtime.start_clock(self.t0, self.t0_event)
            self.status[slot] = PHASE_RUNNING
            for step in range(self.config.steps):
                if self.stopping.is_set():
                    raise Aborted
                self._step_done(rank, step, run_step(built, step))
            if self.config.save_hf is not None:  # every step ran: this rank's shards
                from pipelang.backends.hf_save import write_rank

                write_rank(runtime)
            if transport.stream is not None:
                transport.stream.synchronize()
            self.results[rank] = runtime.result(self.config.check)
            self.status[slot] = PHASE_DONE
            self.hub.finish(rank)
        except Aborted:
            self.status[slot] = PHASE_FAILED
        except BaseException as err:
            self.status[slot] = PHASE_FAILED
            secondary = isinstance(err, PeerFailure)
            with self.lock:
                if self.failure is None or not secondary:
                    self.failure = self.failure or (rank, describe(err), traceback.format_exc())
            self.hub.finish(rank, err)

    def _step_done(self, rank: int, step: int, report: StepReport) -> None:
        with self.lock:
            self.pending.setdefault(step, {})[rank] = report
            while len(self.pending.get(len(self.losses), {})) == self.world:
                done = len(self.losses)
                n = self.program.num_microbatches * self.config.dp
                reports = self.pending.pop(done)
                loss, seconds, metrics = combine([reports[r] for r in range(self.world)], n)
                self.losses.append(loss)
                self.metrics.append(metrics)
                events = step_events([reports[r] for r in range(self.world)])
                self.on_step(done, loss, seconds, metrics, events)


def run_local(program: Program, config: RunConfig, shapes: Shapes, on_step: OnStep) -> Outcome:
    """Run every rank of `program` in this process."""
    return LocalRun(program, config, shapes, on_step).run()
