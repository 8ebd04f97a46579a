"""What a run shows and writes: the progress bar, the summary, the Chrome trace."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from pipelang.backends.metrics import BYTE_KEYS, StepMetrics, TensorBoardLog, finite
from pipelang.backends.rank_base import RankResult
from pipelang.backends.trace_steps import Events, StepTraces, chrome_trace_of
from pipelang.ir import Program


class StepProgress:
    """A rich progress bar over steps (loss, tokens/s, time left); every finished step
    also prints a line and, with `log`, writes a JSON line to that file (with
    `tensorboard`, the same numbers as TensorBoard scalars to that directory). A run
    resumed at step `first` counts its steps from there, to `steps`. `predicted` is the
    simulator's bubble for the schedule (`metrics.predicted_bubble`), in every line."""

    def __init__(
        self,
        steps: int,
        title: str,
        console: Console,
        tokens_per_step: int = 0,
        log: str | None = None,
        first: int = 0,
        tensorboard: str | None = None,
        predicted: float | None = None,
        traces: StepTraces | None = None,
    ) -> None:
        self.steps = steps
        self.traces = traces
        self.tensorboard_dir = tensorboard
        self.tensorboard: TensorBoardLog | None = None
        self.predicted = predicted
        self.first = first
        self.console = console
        self.tokens_per_step = tokens_per_step
        self.log_path = log
        self.log: TextIO | None = None
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[rate]} tokens/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not console.is_terminal,  # off a terminal the step lines say it all
        )
        self.task = self.progress.add_task(title, total=steps - first, loss="-", rate="-")

    def __enter__(self) -> StepProgress:
        if self.log_path is not None:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            kept = _steps_up_to(Path(self.log_path), self.first)
            self.log = open(self.log_path, "w")  # closed in __exit__
            self.log.writelines(kept)
        if self.tensorboard_dir is not None:
            self.tensorboard = TensorBoardLog(self.tensorboard_dir, self.first)
        self.progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.progress.stop()
        if self.log is not None:
            with contextlib.suppress(OSError):
                self.log.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def step(
        self,
        i: int,
        loss: float,
        seconds: float,
        metrics: StepMetrics | None = None,
        events: Sequence[Events] | None = None,
    ) -> None:
        """The `i`-th step of this run (from 0) is done; `metrics`, its numbers over every
        rank (None: not measured, their keys `null`); `events`, every process's actions
        in it where `--trace-every` traces it (`trace_steps.py`)."""
        step = self.first + i
        if events is not None and self.traces is not None:
            self._trace(step + 1, events)
        rate = self.tokens_per_step / seconds if seconds > 0 else 0.0
        self.progress.console.print(
            f"step {step + 1}/{self.steps}  loss {loss:.4f}  {seconds * 1e3:.1f} ms"
        )
        self.progress.update(self.task, advance=1, loss=f"{loss:.4f}", rate=f"{rate:,.0f}")
        if self.log is None and self.tensorboard is None:
            return
        line: dict[str, Any] = {
            "step": step + 1,
            "loss": finite(loss),
            "seconds": seconds,
            "tokens": self.tokens_per_step,
            "tokens_per_s": rate,
            "lr": None,
            "grad_norm": None,
            "peak_memory": None,
            "bubble": None,
            "predicted_bubble": finite(self.predicted),
            **dict.fromkeys(BYTE_KEYS),
        }
        if metrics is not None:
            line["lr"] = finite(metrics.lr)
            line["grad_norm"] = finite(metrics.grad_norm)
            line["peak_memory"] = list(metrics.peak_memory)
            line["bubble"] = finite(metrics.bubble)
            for key in BYTE_KEYS:
                line[key] = list(getattr(metrics, key)) or None
        if self.tensorboard is not None:
            self.tensorboard.write(line)
        if self.log is not None:
            try:
                self.log.write(json.dumps(line) + "\n")
                self.log.flush()
            except OSError as err:  # a full disk, say: the run goes on without its log
                self.console.print(
                    f"warning: cannot write --log {self.log_path} ({err.strerror}); "
                    "the log stops here",
                    markup=False,
                )
                with contextlib.suppress(OSError):
                    self.log.close()
                self.log = None

    def _trace(self, step: int, events: Sequence[Events]) -> None:
        """Write step `step`'s trace file, and with `--tensorboard` its timeline."""
        assert self.traces is not None
        written = self.traces.write(step, events)
        if isinstance(written, str):
            self.console.print(written, markup=False)
        elif self.tensorboard is not None:
            problem = self.tensorboard.timeline(written, step)
            if problem is not None:
                self.console.print(problem, markup=False)


def _steps_up_to(path: Path, step: int) -> list[str]:
    """The lines of a `--log` file up to step `step`: a resumed run goes on from its
    checkpoint's step, dropping what the interrupted run logged after it."""
    if step == 0 or not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # not a line of ours
    return kept


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished run: every rank's result and the mean loss of every step."""

    results: list[RankResult]
    losses: list[float]
    metrics: list[StepMetrics] = field(default_factory=list)
    """Per step, its numbers over every rank (empty where the run did not measure them)."""


def training_seconds(results: list[RankResult]) -> float:
    """From the start of the first step to the end of the last, over every rank."""
    spans = [r.span_ns for r in results if r.span_ns != (0, 0)]
    if not spans:
        return 0.0
    return (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e9


def summary(
    program: Program,
    results: list[RankResult],
    losses: list[float],
    model: str,
    backend: str,
    tokens_per_step: int,
) -> Table:
    """The table printed after a run: throughput, then busy share and memory per rank.

    With `--dp K` there are K x R results (one per process, `rank` replica-major)."""
    seconds = training_seconds(results)
    steps = len(losses)
    rate = steps / seconds if seconds else 0.0
    params = ", ".join(f"{k}={v}" for k, v in program.params)
    table = Table(
        title=f"{program.name}({params}) on {model}, {backend}, {world_text(program, results)}: "
        f"{steps} steps in {seconds:.3f} s, {rate:.2f} steps/s, "
        f"{rate * tokens_per_step:,.0f} tokens/s, final loss {losses[-1]:.4f}"
        if losses
        else f"{program.name}: no step finished",
        title_justify="left",
    )
    slots = any(r.slot_bytes for r in results)
    columns = ["rank", "stage copies", "actions/step", "busy", "peak memory"]
    columns += ["parameters", "gradients", "optimizer"]
    for column in columns + ["data slots"] * slots:
        table.add_column(column, justify="left" if column == "stage copies" else "right")
    for result in sorted(results, key=lambda r: r.rank):
        actions = program.ranks[result.rank // result.tp % program.num_ranks]
        cells = [
            str(result.rank),
            ", ".join(f"{s}/{p}" for s, p, _ in result.copies),
            str(len(actions)),
            f"{100 * result.busy_ns / 1e9 / seconds:.0f}%" if seconds else "-",
            f"{result.peak_memory / 2**20:,.1f} MiB",
            *(_size(n) for n in result.held_bytes),
        ]
        table.add_row(*cells, *[f"{result.slot_bytes:,} B"] * slots)
    return table


def _size(nbytes: int) -> str:
    """Bytes in MiB, or KiB below one MiB (a small model's tensors)."""
    if nbytes < 2**20:
        return f"{nbytes / 2**10:,.1f} KiB"
    return f"{nbytes / 2**20:,.1f} MiB"


def metrics_table(metrics: list[StepMetrics], predicted: float | None) -> Table:
    """The step metrics of `--log` after a run, each saying which step(s) it is of (the
    tokens/s are the summary's title's, the peak memory per rank its column's)."""
    table = Table("metric", "value", "of", title="step metrics", title_justify="left")
    last = metrics[-1] if metrics else None
    lr = "-" if last is None else f"{last.lr:.4g}"
    table.add_row("learning rate", lr, "the last step")
    norm = None if last is None else last.grad_norm
    if norm is None:
        table.add_row("gradient norm", "-", "not taken (--log, --tensorboard or --clip-grad)")
    else:
        table.add_row("gradient norm", f"{norm:.4g}", "the last step, before clipping")
    bubbles = [m.bubble for m in metrics if m.bubble is not None]
    measured = f"{sum(bubbles) / len(bubbles):.3f}" if bubbles else "-"
    table.add_row("bubble, measured", measured, f"the mean over {len(bubbles)} steps")
    table.add_row(
        "bubble, predicted",
        "-" if predicted is None else f"{predicted:.3f}",
        "pipelang simulate, with the schedule's costs",
    )
    return table


def world_text(program: Program, results: list[RankResult]) -> str:
    """`4 ranks`, or with `--dp 2`: `2 x 4 ranks (--dp 2)`; with `--tp`, the processes
    (`16 processes (--dp 2 x 4 ranks x --tp 2)`)."""
    tp = results[0].tp if results else 1
    dp = max(1, len(results) // (program.num_ranks * tp))
    if tp > 1:
        factors = [f"--dp {dp}"] * (dp > 1) + [f"{program.num_ranks} ranks", f"--tp {tp}"]
        return f"{dp * program.num_ranks * tp} processes ({' x '.join(factors)})"
    if dp == 1:
        return f"{program.num_ranks} ranks"
    return f"{dp} x {program.num_ranks} ranks (--dp {dp})"


def chrome_trace(program: Program, results: list[RankResult]) -> str:
    """Every action of every rank in every step as a Chrome trace complete event (pid =
    tid = rank; with `--dp K`, the process's rank, `replica * R + rank`), in the one
    format of pipelang/trace.py, which `viz --trace` and `profile --calibrate` read."""
    return chrome_trace_of(program, [(result.rank, result.events) for result in results])


def write_trace(path: Path, program: Program, results: list[RankResult]) -> None:
    """Write the Chrome trace JSON (open it in Perfetto or chrome://tracing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(chrome_trace(program, results))
