"""`pipelang run` as one rank of a torchrun job (RANK, WORLD_SIZE, MASTER_ADDR set), and
a generated `rank{r}.py` started by hand as such a rank (`pipelang/cli/rank.py`).

Every process compiles the same schedule (and where the ranks run one, its stream
program) and checks it (`preflight.preflight`); rank 0 shows the progress and reports.
torchrun's variables are read through `torchrun_env.torchrun_env`, which names a wrong
one (exit 2).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from pipelang.backends.preflight import RunError, WorldError, preflight
from pipelang.backends.run_report import Predicted, report, step_progress
from pipelang.diagnostics import clip

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pipelang.backends.config import RunConfig
    from pipelang.backends.metrics import StepMetrics
    from pipelang.backends.trace_steps import Events
    from pipelang.backends.worker import RankStopped
    from pipelang.ir import Program
    from pipelang.ir.streams import StreamProgram


def run_as_torchrun_rank(
    program: Program,
    config: RunConfig,
    streams: StreamProgram | None = None,
    predicted: Predicted | None = None,
) -> int:
    """Run this process as its rank of the torchrun job: where the ranks run stream
    programs, its part of `streams` (which the caller compiled), else its action list;
    the exit status (rank 0 reports, with `predicted`)."""
    import contextlib

    from pipelang.backends.report import Outcome
    from pipelang.backends.torchrun_env import torchrun_env
    from pipelang.backends.worker import RankStopped, run_torchrun_rank
    from pipelang.progress import console

    err = console(stderr=True)
    losses: list[float] = []
    measured: list[StepMetrics] = []
    progress = None
    rank = torchrun_env().rank
    if rank == 0:  # the rank that reports: the bar, the lines, --log
        title = f"{program.name} on {config.model} (torchrun)"
        progress = step_progress(program, config, title, err)

    def on_step(
        step: int,
        loss: float,
        seconds: float,
        metrics: StepMetrics,
        events: Sequence[Events] | None = None,
    ) -> None:
        losses.append(loss)
        measured.append(metrics)
        if progress is not None:
            progress.step(step, loss, seconds, metrics, events)

    try:
        with progress or contextlib.nullcontext():
            results = run_torchrun_rank(program, config, on_step, streams)
    except RankStopped as stopped:
        from pipelang.backends.hosts import HostsError

        if isinstance(stopped.cause, HostsError):  # every process knows it: rank 0 says it
            if rank == 0:
                err.print(f"error: {stopped.cause}", markup=False)
            return 2
        err.print(f"error: {torchrun_failure(program, config, stopped, streams)}", markup=False)
        if config.debug:
            err.print("".join(traceback.format_exception(stopped.cause)), markup=False)
        return 1
    if results is None:
        return 0
    status = report(program, config, Outcome(results, losses, measured), predicted)
    if config.save_hf is not None:  # every rank reported: its shards are written
        from pipelang.backends.hf_save import after_run

        status = after_run(program, config, results, status, err)
    return status


def torchrun_failure(
    program: Program, config: RunConfig, stopped: RankStopped, streams: StreamProgram | None
) -> str:
    """One line for a rank under torchrun that failed: where, and what. A peer that went
    away is named as such (rank K when the transfer names it, else its address); this
    rank's own error is the cause."""
    from pipelang.backends.backend import BACKENDS
    from pipelang.backends.mesh import Grid
    from pipelang.backends.processes import action_labels, where
    from pipelang.backends.torchrun_env import torchrun_env
    from pipelang.backends.transport import PeerFailure
    from pipelang.backends.worker import describe

    rank = torchrun_env().rank
    labels = action_labels(program, streams, BACKENDS[config.backend].cuda)
    place = where(labels, rank, *stopped.place, tp=config.tp)
    cause = stopped.cause
    if isinstance(cause, PeerFailure):
        grid = Grid(config.dp, program.num_ranks, config.tp)
        copy, _, tensor = grid.coords(rank)
        who = cause.who()  # a peer is a program rank of the same copy and tensor rank
        if cause.peer is not None:
            who = f"rank {grid.process(copy, cause.peer, tensor)}"
        return (
            f"rank {rank} stopped {place}: {who} went away (it stopped or lost "
            f"its connection; its own output says why)"
        )
    return f"rank {rank} failed {place}: {describe(cause)}"


def run_rank_file(
    rank: int, file: str, program: Program, config: RunConfig, predicted: Predicted | None = None
) -> int:
    """Run a generated `rank{r}.py` started by hand: rank `rank`'s action list of
    `program`, its folder's schedule.json, which the command line read and checked
    (`lowered.read_lowered`), through the executor (the file lists the same calls); the
    environment gives WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun does)."""
    if config.dp == 1:
        os.environ.setdefault("RANK", str(rank))
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    from pipelang.backends.models import ModelError
    from pipelang.backends.torchrun_env import TorchrunEnvError, torchrun_env

    need = f"RANK = copy x {program.num_ranks} + {rank}" if config.dp > 1 else f"RANK={rank}"
    if missing:
        print(
            f"error: set {', '.join(missing)} (this file is rank {rank}; {need})", file=sys.stderr
        )
        return 2
    try:
        env_rank = torchrun_env().rank
    except TorchrunEnvError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not _runs_file(env_rank, rank, program.num_ranks, config.dp):
        print(
            f"error: RANK={env_rank} runs another rank: this file is rank {rank}; {need}",
            file=sys.stderr,
        )
        return 2
    config = config.for_program(program)
    if config.graphs:
        print(
            f"error: {Path(file).name} runs its rank's action list; --graphs runs stream "
            "programs, which `pipelang run ... --graphs` runs itself",
            file=sys.stderr,
        )
        return 2
    from pipelang.backends.metrics import tensorboard_refusal

    refusal = tensorboard_refusal(config.tensorboard)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        preflight(program, config)
    except (RunError, ModelError) as error:
        print(f"error: {clip(str(error))}", file=sys.stderr)
        return 2 if isinstance(error, WorldError) else 1
    return run_as_torchrun_rank(program, config, None, predicted)


def _runs_file(env_rank: int, rank: int, num_ranks: int, dp: int) -> bool:
    """Whether the process RANK `env_rank` runs program rank `rank` (`--dp`: any copy)."""
    return env_rank < num_ranks * dp and env_rank % num_ranks == rank
