"""`pipelang run`: check that a Program fits the model, run it, report, compare.

    run_program(program, config)     run a compiled Program; returns the exit status
    run_rank_file(rank, file, config)  a generated rank{r}.py started by hand

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

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pipelang.backends.backend import BACKENDS
from pipelang.backends.termination import EXIT_STATUS, Terminated
from pipelang.diagnostics import PipelangError, clip
from pipelang.features import refusal
from pipelang.ir import Kind, Program

if TYPE_CHECKING:  # the rest imports torch: only once a run starts, not for `--help`
    import torch
    from rich.console import Console

    from pipelang.backends.config import RunConfig
    from pipelang.backends.models import Shapes
    from pipelang.backends.report import Outcome, StepProgress
    from pipelang.ir.streams import StreamProgram


class RunError(Exception):
    """A run that cannot start: the program does not fit the model or the machine."""


class WorldError(RunError):
    """The processes asked for (`--dp` x ranks) do not fit the machine or torchrun's
    world: a usage error (exit 2)."""


def run_program(program: Program, config: RunConfig) -> int:
    """Run a compiled Program as `config` says; returns the exit status. The config is
    completed by the schedule first (`RunConfig.for_program`: its `partition` line, its
    frozen part).

    SIGTERM at any point is a message and exit 143: while ranks run they stop at a step
    (backends/termination.py); before (set-up) or after (the report, `--check`) this
    process stops at once and says where the run stands."""
    from pipelang.backends.termination import exit_if_stranded, passing_sigterm
    from pipelang.progress import console

    err = console(stderr=True)
    stage = ["set-up"]
    with passing_sigterm(None):
        try:
            status = _run_program(program, config, err, stage)
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


def _run_program(program: Program, config: RunConfig, err: Console, stage: list[str]) -> int:
    """`run_program`; `stage[0]` says where it is: set-up, ranks, report, or stopped (a
    message about SIGTERM already printed)."""
    from pipelang.backends.model_import import set_deadline
    from pipelang.backends.models import ModelError
    from pipelang.backends.processes import RunFailure
    from pipelang.backends.torchrun_env import TorchrunEnvError, torchrun_env, under_torchrun

    config = config.for_program(program)
    set_deadline(config.timeout, "--timeout")  # for loading a model of the user's own
    if config.graphs:
        refusal = graphs_refusal(config)
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
            from pipelang.backends.processes import forkserver

            forkserver()  # its imports overlap the checks below
        shapes = preflight(program, config)
        _resume_note(config, err)
        if torchrun is not None:
            stage[0] = "ranks"
            from pipelang.backends.torchrun_rank import run_as_torchrun_rank

            status = run_as_torchrun_rank(program, config)
            stage[0] = "stopped"  # a rank under torchrun says it itself
            return status
        from pipelang.backends.worker import lower_streams, runs_streams

        streams = lower_streams(program, config.dp) if runs_streams(program, config) else None
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
    status = report(program, config, outcome)
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


def preflight(program: Program, config: RunConfig) -> Shapes:
    """Everything that can be known wrong before a rank starts; raises RunError.

    Returns the shape of every stage's output (the receive buffers' shapes).
    """
    if config.frozen_layers and program.frozen is None:
        raise RunError(
            f"--frozen-layers {config.frozen_layers}: `{program.name}` has no frozen part "
            "(no `frozen` line), so no layers would run as one; drop the option"
        )
    if program.frozen is not None and config.frozen_layers is not None and config.frozen_layers < 1:
        raise RunError(
            f"`{program.name}` runs a frozen part (`P`), which needs at least one "
            "layer: --frozen-layers 1 or more"
        )
    shapes = program.shapes
    if shapes is not None and config.seq_len is not None and config.seq_len < max(shapes.lengths):
        raise RunError(
            f"--seq-len {config.seq_len}: `{program.name}` has micro-batches of "
            f"{max(shapes.lengths)} tokens; give at least that, or leave --seq-len out"
        )
    refused = eviction_refusal(program, config) or chunks_refusal(program, config)
    for consumer, used in (
        ("--dp", config.dp > 1),
        ("--mixed-precision", config.mixed_precision),
        ("--clip-grad", config.clip_grad is not None),
        ("checkpoints", config.save or config.resume),
    ):
        refused = refused or (refusal(program, consumer) if used else None)
    if refused is not None:
        raise RunError(refused)
    if config.predict_weights and (program.weights is None or not program.weights.stashes):
        policy = "synchronous" if program.weights is None else "`weights latest`"
        raise RunError(
            f"--predict-weights: `{program.name}` is {policy}; weight prediction is for "
            "asynchronous schedules that stash versions (`weights stash` or `weights K`: "
            "pipedream, pipedream-2bw), where a forward's weights are known to be stale"
        )
    if config.resume is not None:
        from pipelang.backends.checkpoint import CheckpointError, verify

        try:
            verify(config)
        except CheckpointError as err:
            raise RunError(str(err)) from None
    from pipelang.backends.models import plan_stages

    _check_world(program, config)
    plan = plan_stages(config.spec, program.num_stages, config.partition)
    if plan.ties and program.weights is not None:
        raise RunError(
            f"`{program.name}` is asynchronous (`weights {program.weights.text()}`) and "
            f"{config.model} ties weights across stages, whose copies are kept equal at "
            "`step`, which an asynchronous schedule does not have; untie them or use a "
            "synchronous schedule"
        )
    for rank in range(program.num_ranks):
        _check_rank(program, rank)
    return plan.shapes


def _check_world(program: Program, config: RunConfig) -> None:
    """The processes the run needs are there: a GPU per rank for nccl, and under torchrun
    WORLD_SIZE = --dp x the program's ranks; raises WorldError."""

    from pipelang.backends.torchrun_env import torchrun_env, under_torchrun

    world = program.num_ranks * config.dp
    ranks = f"{program.num_ranks} ranks"
    if config.dp > 1:
        ranks = f"{world} ranks (--dp {config.dp} x {ranks})"
    torchrun = torchrun_env() if under_torchrun() else None
    if torchrun is not None and torchrun.world != world:
        raise WorldError(
            f"torchrun started {torchrun.world} processes but the run needs "
            f"{ranks}; WORLD_SIZE must be --dp x the program's ranks"
        )
    problem = BACKENDS[config.backend].world_problem(world, ranks, torchrun)
    if problem is not None:
        raise WorldError(problem)
    if config.rank_hosts is not None and not under_torchrun():
        from pipelang.backends.hosts import HostsError, mismatch, read_hosts, this_host

        try:  # every process starts here: each must be on this host
            hosts = read_hosts(config.rank_hosts)
        except HostsError as error:
            raise WorldError(str(error)) from error
        problem = mismatch(config.rank_hosts, hosts, [this_host()] * world)
        if problem is not None:
            raise WorldError(problem.split(". Launch")[0] + " (every process runs here)")


def _check_rank(program: Program, rank: int) -> None:
    """`rank`'s list is one the runtime can run: one copy of a stage, a `step` (in a
    synchronous schedule), and an allreduce for each replicated stage; raises RunError."""
    copies = program.stage_copies(rank)
    twice = [s for s, n in Counter(s for s, _ in copies).items() if n > 1]
    if twice:
        raise RunError(
            f"rank {rank} holds two copies of stage {twice[0]}; the runtime needs "
            "the replicas of a stage on different ranks"
        )
    kinds = {a.kind for a in program.ranks[rank]}
    if copies and Kind.STEP not in kinds and program.weights is None:
        raise RunError(
            f"rank {rank}'s program has no `step`; run a fully compiled program "
            "(the insert-sync pass adds the optimizer step)"
        )
    reduced = {(a.stage, a.pipeline) for a in program.ranks[rank] if a.kind is Kind.ALLREDUCE}
    for stage, pipe in copies:
        if len(set(program.replicas(stage))) > 1 and (stage, pipe) not in reduced:
            raise RunError(
                f"stage {stage} has replicas on ranks {program.replicas(stage)} but "
                f"rank {rank} never runs `allreduce@{stage}/{pipe}`; the replicas "
                "would drift apart"
            )


def eviction_refusal(program: Program, config: RunConfig) -> str | None:
    """Why the runtime cannot run `program`'s evictions (`E`, `H`, `L`) with `config`;
    None when it has none or they can run: on the CPU (gloo, local), without `R`."""
    if program.first_eviction() is None:
        return None

    cuda = BACKENDS[config.backend].computes_on_gpu()
    return (cuda and refusal(program, "a GPU")) or refusal(program, "the runtime's evictions")


def chunks_refusal(program: Program, config: RunConfig) -> str | None:
    """Why the runtime cannot run `program`'s sequence chunks with `config`, or None."""
    if program.chunks is None:
        return None
    count = program.chunks.count
    refused = refusal(program, "the runtime's chunks")
    if refused is not None:
        return refused
    from pipelang.backends.models import MODEL_FAMILIES

    family, _, name = config.model.partition(":")
    if family not in MODEL_FAMILIES:
        return (
            f"`{program.name}` splits micro-batches into {count} sequence chunks, which the "
            "runtime runs on the built-in models (`--model gpt:SIZE` or `llama:SIZE`), whose "
            f"attention reads the keys and values of earlier chunks; `--model {config.model}` "
            "cannot yet"
        )
    size = MODEL_FAMILIES[family].get(name)
    seq_len = config.seq_len or (size.seq_len if size is not None else count)
    if seq_len < count:
        return (
            f"`{program.name}` splits each sequence into {count} chunks, more than its "
            f"{seq_len} tokens: raise --seq-len or lower the chunks"
        )
    return None


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

    from pipelang.backends.codegen import GRAPH_WARMUP
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


def report(program: Program, config: RunConfig, outcome: Outcome) -> int:
    """Print the summary, write the trace, run the check; the exit status (143 when
    SIGTERM stopped the run early: there is no check then)."""
    from pipelang.backends.report import summary, write_trace
    from pipelang.backends.termination import stopped_line
    from pipelang.progress import console

    stopped = outcome.results[0].stopped_after if outcome.results else None
    done = len(outcome.losses)
    if stopped is None and done != config.run_steps:  # never exit 0 on an unfinished run
        console(stderr=True).print(
            f"error: the run ended after {done} of its {config.run_steps} steps and no rank "
            "said why; a run that does not finish its steps fails",
            markup=False,
        )
        return 1
    out = console()
    tokens = tokens_per_step(program, config)
    out.print(
        summary(program, outcome.results, outcome.losses, config.model, config.backend, tokens)
    )
    planned = plan_line(program, config, outcome)
    if planned:
        out.print(planned, markup=False)
    if config.trace:
        write_trace(Path(config.trace), program, outcome.results)
        out.print(f"wrote the trace of every action to {config.trace}", markup=False)
    if program.weights is not None:
        from pipelang.backends.versions import versions_line

        out.print(versions_line(program, outcome.results), markup=False)
    if stopped is not None:
        err = console(stderr=True)
        err.print(stopped_line(stopped, config.save), markup=False)
        return EXIT_STATUS
    if not config.check:
        return 0
    from pipelang.backends.reference import compare, train_reference

    device = outcome_device(config)
    from pipelang.backends.worker import rank_threads

    world = program.num_ranks * config.dp
    backend = BACKENDS[config.backend]  # the reference as many threads as a CPU process
    threads = rank_threads(world) if backend.processes and not backend.cuda else None
    if program.weights is not None:
        from pipelang.backends.async_reference import train_async_reference

        reference = train_async_reference(config, program, device, threads)
    else:
        # the reference trains on every copy's micro-batches: K x N per step
        from pipelang.backends.summation import accumulation

        n = program.num_microbatches * config.dp
        sums = accumulation(program, config.dp)
        reference = train_reference(config, n, device, threads, sums, program)
    comparison = compare(reference, outcome.results, outcome.losses, config)
    out.print(comparison.render(), markup=False)
    return 0 if comparison.ok else 1


def plan_line(program: Program, config: RunConfig, outcome: Outcome) -> str | None:
    """The plan's predicted step time beside the measured one, when the schedule is a
    file `pipelang plan` wrote; None otherwise."""
    from pipelang.backends.report import training_seconds
    from pipelang.planner.write import read_prediction

    path = Path(program.source)
    if not outcome.losses or not path.is_file():
        return None
    try:
        predicted = read_prediction(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError):
        return None
    if predicted is None:
        return None
    measured = 1e3 * training_seconds(outcome.results) / len(outcome.losses)
    line = (
        f"plan: predicted {predicted.ms:.3f} ms per step ({predicted.model} profiled on "
        f"{predicted.device}); measured {measured:.3f} ms per step here, "
        f"{measured / predicted.ms:.2f}x the prediction"
    )
    if predicted.model != config.model:
        line += f" (this run trains {config.model}, not the profiled model)"
    if predicted.assumed is not None:
        line += f"; the plan assumed {predicted.assumed}"
    return line


def step_progress(program: Program, config: RunConfig, title: str, err: Console) -> StepProgress:
    """The progress bar, step lines and `--log` of a run."""
    from pipelang.backends.report import StepProgress

    tokens = tokens_per_step(program, config)
    return StepProgress(config.steps, title, err, tokens, config.log, config.first_step)


def tokens_per_step(program: Program, config: RunConfig) -> int:
    """The tokens one step trains on: micro-batches x copies x sequences x length (each
    micro-batch's where they differ)."""
    from pipelang.backends.models import plan_stages

    if program.shapes is not None:
        shapes = program.shapes
        return config.dp * sum(shapes.tokens(mb) for mb in range(program.num_microbatches))
    seq_len = plan_stages(config.spec, program.num_stages, config.partition).seq_len
    return program.num_microbatches * config.dp * config.micro_batch_size * seq_len


def outcome_device(config: RunConfig) -> torch.device:
    """Where the `--check` reference trains: the device the run used."""
    import torch

    if BACKENDS[config.backend].computes_on_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
