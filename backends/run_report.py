"""The end of a run (`report`: the summary, the plan's prediction beside the measured
step, the trace, `--check`) and its progress while it runs (`step_progress`). The
launcher (backends/launch.py) and rank 0 under torchrun (torchrun_rank.py) both call
them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pipelang.backends.backend import BACKENDS
from pipelang.backends.termination import EXIT_STATUS
from pipelang.ir import Program

if TYPE_CHECKING:  # they import torch: only once a run starts
    import torch
    from rich.console import Console

    from pipelang.backends.config import RunConfig
    from pipelang.backends.report import Outcome, StepProgress


class Predicted(Protocol):
    """What a plan `pipelang plan` wrote predicts of its step (`planner.write.Prediction`,
    which the command line reads from the schedule's file and hands the run)."""

    @property
    def ms(self) -> float: ...

    @property
    def model(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def assumed(self) -> str | None: ...


def report(
    program: Program, config: RunConfig, outcome: Outcome, predicted: Predicted | None = None
) -> int:
    """Print the summary (and beside it the step time `predicted` where the schedule is
    a plan), write the trace, run the check; the exit status (143 when SIGTERM stopped
    the run early: there is no check then)."""
    from pipelang.backends.metrics import predicted_bubble
    from pipelang.backends.report import metrics_table, summary, write_trace
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
    out.print(metrics_table(outcome.metrics, predicted_bubble(program)))
    planned = plan_line(config, outcome, predicted)
    if planned:
        out.print(planned, markup=False)
    if config.trace and config.trace_every is not None:
        from pipelang.backends.trace_steps import written_line

        out.print(written_line(config, done), markup=False)
    elif config.trace:
        write_trace(Path(config.trace), program, outcome.results)
        out.print(f"wrote the trace of every action to {config.trace}", markup=False)
        if config.tensorboard is not None and done:
            from pipelang.backends.metrics import timeline_figure

            last = config.first_step + done
            out.print(timeline_figure(config.tensorboard, config.trace, last), markup=False)
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
        sums = accumulation(program, config.dp, config.shard)
        reference = train_reference(config, n, device, threads, sums, program)
    comparison = compare(reference, outcome.results, outcome.losses, config)
    out.print(comparison.render(), markup=False)
    return 0 if comparison.ok else 1


def plan_line(config: RunConfig, outcome: Outcome, predicted: Predicted | None) -> str | None:
    """The plan's predicted step time beside the measured one, when the schedule is a
    file `pipelang plan` wrote (`predicted`); None otherwise."""
    from pipelang.backends.report import training_seconds

    if not outcome.losses or predicted is None:
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
    """The progress bar, step lines, `--log` and `--tensorboard` of a run."""
    from pipelang.backends.metrics import predicted_bubble
    from pipelang.backends.report import StepProgress

    tokens = tokens_per_step(program, config)
    first, board = config.first_step, config.tensorboard
    predicted = predicted_bubble(program) if config.logs_metrics else None
    traces = None
    if config.trace is not None and config.trace_every is not None:
        from pipelang.backends.trace_steps import StepTraces

        traces = StepTraces(program, config.trace, config.trace_every)
    return StepProgress(
        config.steps, title, err, tokens, config.log, first, board, predicted, traces
    )


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
