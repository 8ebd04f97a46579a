"""`pipelang run`: check that a Program fits the model, run it, report, compare.

    run_program(program, config)     run a compiled Program; returns the exit status
    run_rank_file(rank, file, ...)   a rank{r}.py (`compile -o`) started by hand

Backends: `gloo` (one CPU process per rank, started here), `nccl` (one GPU per rank),
`local` (every rank in this process). Started by torchrun (RANK and WORLD_SIZE in the
environment), this process is one rank and rank 0 reports.

`--dp K` runs K data-parallel copies of the whole pipeline: K x R processes (threads
for `local`), the process of rank r in copy k being `k * R + r`. Each copy trains on its
own N of the step's K x N micro-batches; the loss is scaled by 1/(N*K) and every stage's
gradients are summed over all its copies (the schedule's replicas times K).

Exit status: 0 when the run (and `--check`) passed; 1 when the program does not fit the
model, a rank failed, or the check found a difference over the tolerance; 2 when the
processes do not fit the machine or torchrun's world (a usage error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipelang.backends.backend import BACKENDS, runs_streams
from pipelang.backends.preflight import RunError, WorldError, preflight
from pipelang.backends.run_report import Predicted, report, step_progress
from pipelang.backends.termination import EXIT_STATUS, Terminated
from pipelang.diagnostics import InternalError, PipelangError, clip
from pipelang.ir import Program

if TYPE_CHECKING:  # the rest imports torch: only once a run starts, not for `--help`
    from rich.console import Console

    from pipelang.backends.config import RunConfig
    from pipelang.backends.models import Shapes
    from pipelang.backends.report import Outcome
    from pipelang.ir.streams import StreamProgram

__all__ = ["RunError", "WorldError", "preflight", "report", "run_program"]


def run_program(
    program: Program,
    config: RunConfig,
    compile_streams: Callable[[], StreamProgram] | None = None,
    predicted: Predicted | None = None,
) -> int:
    """Run a compiled Program as `config` says; returns the exit status. The config is
    completed by the schedule first (`RunConfig.for_program`: its `partition` line, its
    frozen part). Where the ranks run stream programs (`backend.runs_streams`), they run
    the checked stream program that `compile_streams` gets from the compiler
    (`compiler.stream_program`), asked once the run's checks passed (its E0506 comes
    after them); nothing is lowered here. `predicted`: what the plan that the schedule's
    file is predicts (`run_report`).

    SIGTERM at any point is a message and exit 143: while ranks run they stop at a step
    (backends/termination.py); before (set-up) or after (the report, `--check`) this
    process stops at once and says where the run stands."""
    from pipelang.backends.termination import exit_if_stranded, passing_sigterm
    from pipelang.progress import console

    err = console(stderr=True)
    stage = ["set-up"]
    with passing_sigterm(None):
        try:
            status = _run_program(program, config, err, stage, compile_streams, predicted)
        except Terminated:
            status = EXIT_STATUS
    if status == EXIT_STATUS and stage[0] != "stopped":
        err.print(_terminated_line(stage[0], config), markup=False)
    exit_if_stranded(status)
    return status


def _terminated_line(stage: str, config: RunConfig) -> str:
    """What a run stopped by SIGTERM outside a step boundary says, by where it was."""
    where = _where_to_resume(config)
    if stage == "set-up":
        return f"terminated (SIGTERM) during set-up, before any step: nothing was saved{where}"
    if stage == "report":
        after = "the report and --check" if config.check else "the report"
        return f"terminated (SIGTERM) after the last step, during {after}{where}"
    return f"terminated (SIGTERM): every rank stopped{where}"


def _run_program(
    program: Program,
    config: RunConfig,
    err: Console,
    stage: list[str],
    compile_streams: Callable[[], StreamProgram] | None,
    predicted: Predicted | None,
) -> int:
    """`run_program`; `stage[0]` says where it is: set-up, ranks, report, or stopped (a
    message about SIGTERM already printed)."""
    from pipelang.backends.metrics import tensorboard_refusal
    from pipelang.backends.model_import import set_deadline
    from pipelang.backends.models import ModelError
    from pipelang.backends.processes import RunFailure
    from pipelang.backends.torchrun_env import TorchrunEnvError, torchrun_env, under_torchrun

    config = config.for_program(program)
    set_deadline(config.timeout, "--timeout")  # for loading a model of the user's own
    refusal = graphs_refusal(config) if config.graphs else None
    refusal = refusal or tensorboard_refusal(config.tensorboard)
    if refusal is not None:
        err.print(f"error: {refusal}", markup=False)
        return 2
    try:
        torchrun = torchrun_env() if under_torchrun() else None
    except TorchrunEnvError as error:
        err.print(f"error: {error}", markup=False)
        return 2
    try:
        if BACKENDS[config.backend].processes and torchrun is None:
            from pipelang.backends.rank_server import forkserver

            forkserver()  # (started already by `pipelang run`) its imports overlap preflight
        shapes = preflight(program, config)
        _resume_note(config, err)
        streams = None
        if runs_streams(program, config):
            if compile_streams is None:
                raise InternalError("a run of stream programs without the compiler's")
            streams = compile_streams()
        if torchrun is not None:
            stage[0] = "ranks"
            from pipelang.backends.torchrun_rank import run_as_torchrun_rank

            status = run_as_torchrun_rank(program, config, streams, predicted)
            stage[0] = "stopped"  # a rank under torchrun says it itself
            return status
        stage[0] = "ranks"
        outcome = _run_here(program, config, shapes, err, streams)
    except PipelangError as error:
        err.print(error.render(), markup=False)
        return 1
    except (RunError, ModelError) as error:
        err.print(f"error: {clip(str(error))}", markup=False)
        return 2 if isinstance(error, WorldError) else 1
    except RunFailure as failure:
        err.print(f"error: {failure}", markup=False)
        if config.debug and failure.details:
            err.print(failure.details, markup=False)
        return 1
    except KeyboardInterrupt:
        err.print(f"interrupted: every rank stopped{_where_to_resume(config)}", markup=False)
        return 130
    except SystemExit as exit_:  # the user's model (its forward, say) ended the run
        err.print(f"error: {_exit_line(exit_, stage[0])}", markup=False)
        return 1
    stage[0] = "report"
    status = report(program, config, outcome, predicted)
    if config.save_hf is not None:
        from pipelang.backends.hf_save import after_run

        status = after_run(program, config, outcome.results, status, err)
    stage[0] = "stopped"
    return status


def _exit_line(exit_: SystemExit, stage: str) -> str:
    """A sys.exit() the model's code called in this process, in words."""
    when = "before any step" if stage == "set-up" else "before the run finished its steps"
    return (
        f"the model's code called sys.exit({exit_.code!r}) {when}; a run that does not "
        "finish its steps fails"
    )


def _resume_note(config: RunConfig, err: Console) -> None:
    """Say (once: rank 0 under torchrun) when the resumed run's learning rate jumps."""
    from pipelang.backends.torchrun_env import torchrun_env, under_torchrun

    if config.resume is None or (under_torchrun() and torchrun_env().rank != 0):
        return
    from pipelang.backends.checkpoint import lr_note

    note = lr_note(config)
    if note is not None:
        err.print(note, markup=False)


def _where_to_resume(config: RunConfig) -> str:
    """Where an interrupted run with `--save` can resume from; empty without one."""
    if config.save is None:
        return ""
    from pipelang.backends.checkpoint import CheckpointError, find

    try:
        path, step = find(config.save)
    except CheckpointError:
        return f"; no checkpoint was complete in {config.save} yet"
    return f"; the latest checkpoint is {path} (step {step}): go on with --resume {config.save}"


def _run_streams(
    program: Program,
    config: RunConfig,
    shapes: Shapes,
    err: Console,
    title: str,
    lowered: StreamProgram,
) -> Outcome:
    """Run a checked stream program on the executor: every rank in this process, on the
    CPU in an adversarial order, on a GPU captured as one CUDA graph (`local --graphs`)."""
    import torch

    from pipelang.backends.executor import GRAPH_WARMUP
    from pipelang.backends.local import local_device
    from pipelang.backends.stream_executor import StreamExecutor

    device = local_device()
    executor = StreamExecutor(program, lowered, config, shapes, config.stream_seed, device)
    held = ", ".join(f"{b / 1024:.1f}" for b in executor.allocated_bytes)
    if device.type == "cuda":
        what = (
            f"every rank's streams on {torch.cuda.get_device_name(device)}, captured as one "
            f"CUDA graph after {GRAPH_WARMUP} eager steps"
        )
    else:
        what = (
            f"no CUDA here: the stream program runs on the CPU executor, its "
            f"{len(lowered.ops)} ops interleaved by seed {config.stream_seed} + step, dead "
            "slots NaN (no capture)"
        )
    err.print(f"{what}; data slots per rank {held} KiB", markup=False)
    with step_progress(program, config, title, err) as progress:
        return executor.run(progress.step)


def graphs_refusal(config: RunConfig) -> str | None:
    """Why `--graphs` cannot run with `config`; None when it runs."""
    if config.trace:
        return (
            "--trace times every action, and a captured iteration has no per-action times; "
            "run without --graphs to trace the same stream program run eagerly"
        )
    return None


def _run_here(
    program: Program,
    config: RunConfig,
    shapes: Shapes,
    err: Console,
    streams: StreamProgram | None = None,
) -> Outcome:
    ranks = f"{program.num_ranks} ranks"
    if config.dp > 1:
        ranks = f"{config.dp} x {ranks}"
    title = f"{program.name} on {config.model} ({config.backend}, {ranks})"
    from pipelang.backends.termination import passing_sigterm

    backend = BACKENDS[config.backend]
    if streams is not None and not backend.processes:
        with passing_sigterm(None):
            return _run_streams(program, config, shapes, err, title, streams)
    with step_progress(program, config, title, err) as progress:
        if not backend.processes:
            from pipelang.backends.local import run_local

            with passing_sigterm(None):
                return run_local(program, config, shapes, progress.step)
        from pipelang.backends.processes import launch

        return launch(program, config, shapes, progress.step, streams)
