"""`--trace OUT.json --trace-every K`: the trace of steps K, 2K, ... only, each written
as it ends to its own file, `OUT-stepK.json` (`step_path`), and with `--tensorboard`
that step's measured timeline as TensorBoard's image `timeline` at step K.

A rank times its actions only in a traced step (`begin`: on a GPU it times every step
anyway, for the summary's busy share) and hands that step's events on with its step
report (`take`), keeping none after; the reporting process (the launcher, or rank 0
under torchrun, which gathers them in the step's report) writes the step's file at once
(`StepTraces`), so a long run holds no more than one step's events anywhere. Steps are
counted from 1, as `--log`, TensorBoard and `--save-every` count them; inside the file
each event's `args.step` is the step's index from 0, as in a whole run's trace.

One file per step rather than one file of every traced step: each is a complete Chrome
trace the moment it is written (a run killed later keeps every step written before), it
stays as small as one step, and `pipelang viz --trace OUT-stepK.json` draws it without
`--step`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelang.ir import Program
from pipelang.trace import complete, document, metadata, rank_name

if TYPE_CHECKING:
    from pipelang.backends.config import RunConfig
    from pipelang.backends.runtime import RankRuntime

Events = tuple[tuple[int, int, int, int], ...]
"""One rank's actions in a step: (step index, action index, start ns, end ns)."""


def traces(config: RunConfig, step: int) -> bool:
    """Whether `--trace-every` traces step index `step` (the (step + 1)-th step)."""
    every = config.trace_every
    return config.trace is not None and every is not None and (step + 1) % every == 0


def step_path(trace: str, step: int) -> Path:
    """Where step `step` (from 1) of `--trace OUT.json` goes: `OUT-step{step}.json`."""
    path = Path(trace)
    return path.with_name(f"{path.stem}-step{step}{path.suffix}")


def begin(runtime: RankRuntime, step: int) -> bool:
    """Before step index `step` under `--trace-every`: time its actions where the step is
    traced (on the CPU; a GPU times every step with events); whether it is."""
    traced = traces(runtime.config, step)
    if runtime.gpu_events is None:
        runtime.timed = traced
    return traced


def take(runtime: RankRuntime, gpu_before: int) -> Events:
    """The events of the step just run (on a GPU, its events after the first
    `gpu_before`, waited for), let go of on the CPU."""
    zero = runtime.t0_event
    if runtime.gpu_events is not None and zero is not None:
        mine = runtime.gpu_events[gpu_before:]
        for *_, end in mine:
            end.synchronize()
        return tuple(
            (step, index, int(zero.elapsed_time(b) * 1e6), int(zero.elapsed_time(e) * 1e6))
            for step, index, b, e in mine
        )
    events = tuple(runtime.events)
    runtime.events.clear()
    return events


def step_events(reports: Sequence[Any]) -> list[Events] | None:
    """Every process's events of one step, in rank order (`StepReport.events`); None
    where the step is not traced."""
    if all(report.events is None for report in reports):
        return None
    return [report.events or () for report in reports]


def chrome_trace_of(
    program: Program, ranks: Sequence[tuple[int, Sequence[tuple[int, int, int, int]]]]
) -> str:
    """`chrome_trace` of each process's (rank, events): (step, action index, start ns,
    end ns); a whole run's, or one step's (`--trace-every`, backends/trace_steps.py)."""
    events: list[str] = []
    for rank, timed in ranks:
        events.append(metadata("process_name", rank, rank, name=rank_name(rank)))
        actions = program.ranks[rank % program.num_ranks]
        for step, index, start, end in timed:
            action = actions[index]
            more = f',"args":{{"step":{step},"action":{index}}}'
            kind = action.kind.value
            events.append(
                complete(action.text(), kind, rank, rank, start / 1e3, (end - start) / 1e3, more)
            )
    return document(events)


class StepTraces:
    """The reporting process's writer of each traced step's file."""

    def __init__(self, program: Program, trace: str, every: int) -> None:
        self.program = program
        self.trace = trace
        self.every = every

    def write(self, step: int, events: Sequence[Events]) -> Path | str:
        """Write step `step` (from 1) of every process (`events`, in rank order) to its
        file, replaced whole (a reader never sees half a file); the path, or the warning
        to print where it cannot be written (the run goes on)."""
        path = step_path(self.trace, step)
        text = chrome_trace_of(self.program, list(enumerate(events)))
        part = path.with_name(path.name + ".part")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(text)
            os.replace(part, path)
        except OSError as err:
            with contextlib.suppress(OSError):
                part.unlink()
            return f"warning: cannot write the trace of step {step} to {path} ({err.strerror})"
        return path


def written_line(config: RunConfig, done: int) -> str:
    """What the end of a run says of the step files it wrote in its `done` steps: those
    that are files now (one that could not be written was warned of as the run went)."""
    every, first, trace = config.trace_every or 1, config.first_step, config.trace or ""
    steps = [s for s in range(first + 1, first + done + 1) if s % every == 0]
    if not steps:
        return f"wrote no trace: no step of this run is a multiple of --trace-every {every}"
    written = [s for s in steps if step_path(trace, s).is_file()]
    path = Path(trace)
    name = path.with_name(f"{path.stem}-stepK{path.suffix}")
    if not written:
        return f"wrote no trace: the trace of {_steps(steps)} could not be written"
    line = f"wrote the trace of {_steps(written)} (--trace-every {every}) to {name}, a file each"
    missing = [s for s in steps if s not in written]
    return line + (f"; that of {_steps(missing)} could not be written" if missing else "")


def _steps(steps: list[int]) -> str:
    """`step 4`, `steps 2, 4`, `steps 2, ..., 40`."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    shown = ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, ..., {steps[-1]}"
    return f"steps {shown}"
