"""The numbers a run shows per step besides its loss: what each rank reports after a step
(`StepReport`), the step over every rank (`StepMetrics`, which `combine` makes where
the launcher combines the losses), the simulator's bubble for the schedule
(`predicted_bubble`), and `--tensorboard`'s writer (`TensorBoardLog`, `timeline_figure`).

    lr                the step's learning rate (`RunConfig.lr_schedule_at`), as the ranks set it
    grad_norm         the global gradient norm before clipping, each stage counted once
                      (`rank_sync.grad_square_sum`); taken with --clip-grad, or where
                      --log or --tensorboard asks (one collective per step), else None
    peak_memory       per rank, bytes (`runtime.peak_memory`: resident on the CPU)
    param_bytes       per rank, the bytes of its parameters (its stage copies' and frozen
                      part's; `runtime.held_bytes`)
    grad_bytes        per rank, the most bytes of gradients it held at an optimizer step
    optimizer_bytes   per rank, the bytes of its optimizer state (momentum, Adam's two
                      moments) and, with --mixed-precision, its fp32 master weights
    bubble            1 - the ranks' busy compute time / (ranks x the step's time)
    predicted_bubble  `pipelang simulate`'s bubble ratio, with the schedule's costs
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelang.ir import Program

EXTRA = "pip install pipelang[tensorboard]"
"""How to install what `--tensorboard` needs."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one rank reports after each step (to the launcher; under torchrun, to rank 0
    in the step's one all-reduce)."""

    losses: dict[int, float]
    """The (unscaled) loss of every micro-batch whose last stage ran here."""
    seconds: float
    lr: float
    busy_ns: int | None
    """Time in compute actions this step; None where not measured (a captured graph, a
    GPU without --log or --tensorboard)."""
    peak_memory: int
    grad_norm: float | None
    """The global norm before clipping where the step took it; None otherwise."""
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    """The bytes of the rank's tensors (see the module docstring; `runtime.held_bytes`)."""
    events: tuple[tuple[int, int, int, int], ...] | None = None
    """The step's actions (step, action index, start ns, end ns) where `--trace-every`
    traces it (backends/trace_steps.py); None otherwise."""


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One step over every rank of the run (`combine`)."""

    lr: float
    grad_norm: float | None
    peak_memory: tuple[int, ...]
    """Per process, in rank order (`--dp`: `replica * R + rank`)."""
    bubble: float | None
    param_bytes: tuple[int, ...] = ()
    grad_bytes: tuple[int, ...] = ()
    optimizer_bytes: tuple[int, ...] = ()
    """Per process, in rank order, as `peak_memory`."""


def combine(reports: Sequence[StepReport], n: int) -> tuple[float, float, StepMetrics]:
    """Every process's report of one step, in rank order: the step's mean loss over its
    `n` micro-batches (added in micro-batch order, as --check does), its time (the
    slowest rank's), and its metrics."""
    merged = {mb: v for report in reports for mb, v in report.losses.items()}
    loss = sum(merged.get(mb, float("nan")) for mb in range(n)) / n
    seconds = max(report.seconds for report in reports)
    norms = [r.grad_norm for r in reports if r.grad_norm is not None]
    peaks = tuple(report.peak_memory for report in reports)
    busy = [report.busy_ns for report in reports]
    bubble = None
    if seconds > 0 and all(b is not None for b in busy):
        idle = 1.0 - sum(b or 0 for b in busy) / 1e9 / (len(reports) * seconds)
        bubble = min(1.0, max(0.0, idle))
    metrics = StepMetrics(
        reports[0].lr,
        norms[0] if norms else None,
        peaks,
        bubble,
        tuple(r.param_bytes for r in reports),
        tuple(r.grad_bytes for r in reports),
        tuple(r.optimizer_bytes for r in reports),
    )
    return loss, seconds, metrics


BYTE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")
"""The per-rank byte counts of a `--log` line besides `peak_memory` (`StepMetrics`)."""


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of `tensors` (torch tensors; None skipped), each storage once: two
    views of one tensor, or one tensor under two names, count once. A sharded (DTensor)
    tensor counts its local shard, what this process holds (`--shard`)."""
    seen: dict[tuple[int, str], int] = {}
    for tensor in tensors:
        if tensor is None or tensor.is_meta:
            continue
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor: its local shard
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), str(tensor.device))
        seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())


_predicted: list[tuple[Program, float | None]] = []
"""The last program asked of `predicted_bubble` and its answer (once per run)."""


def predicted_bubble(program: Program) -> float | None:
    """The bubble ratio `pipelang simulate` gives `program` with the costs it carries
    (its `cost` line): the simulator's `Timeline.bubble_ratio` of the same timeline
    (`Compilation.timeline`); None where the costs cannot be simulated. Computed once
    per run: the step lines and the end of the run ask of the same Program."""
    if _predicted and _predicted[0][0] is program:
        return _predicted[0][1]
    from pipelang.diagnostics import PipelangError
    from pipelang.ir.graph import op_graph
    from pipelang.sim.timeline import simulate

    try:
        costs = program.costs.for_kinds(program.kinds)
        bubble: float | None = simulate(program, op_graph(program), costs).bubble_ratio
    except PipelangError:
        bubble = None
    _predicted[:] = [(program, bubble)]
    return bubble


def finite(value: float | None) -> float | None:
    """`value`, or None where it is not a finite number (strict JSON has no NaN)."""
    return value if value is not None and math.isfinite(value) else None


# ---- --tensorboard ------------------------------------------------------------------------


def tensorboard_refusal(directory: str | None) -> str | None:
    """Why `--tensorboard DIR` cannot write (the extra is not installed, DIR cannot be
    made); None when it can, or without the option."""
    if directory is None:
        return None
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return (
            f"--tensorboard needs the tensorboard package, an optional extra: {EXTRA} "
            "(or pip install tensorboard)"
        )
    from pipelang.diagnostics import quote

    path = Path(directory)
    try:
        if path.exists() and not path.is_dir():
            return f"--tensorboard: {quote(directory)} is a file; give a directory"
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a name too long, say: exists() raises it too
        return f"--tensorboard: cannot make {quote(directory)}: {err.strerror}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"--tensorboard: cannot write in {quote(directory)}"
    return None


SCALARS = ("loss", "lr", "grad_norm", "seconds", "tokens_per_s", "bubble", "predicted_bubble")
"""The keys of a `--log` line that TensorBoard gets as scalars, under the same names
(and `peak_memory/rankR`, `param_bytes/rankR`, `grad_bytes/rankR`,
`optimizer_bytes/rankR` per rank)."""


class TensorBoardLog:
    """`--tensorboard DIR`: each step's `--log` line as scalars, at the same step (from
    1). A resumed run (from step `first`) drops what the run it goes on from wrote
    after its checkpoint (`purge_step`)."""

    def __init__(self, directory: str, first: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(directory, purge_step=first + 1 if first else None)

    def write(self, line: dict[str, Any]) -> None:
        step = line["step"]
        for key in SCALARS:
            if line.get(key) is not None:
                self.writer.add_scalar(key, line[key], step)
        for key in ("peak_memory", *BYTE_KEYS):
            for rank, nbytes in enumerate(line.get(key) or ()):
                self.writer.add_scalar(f"{key}/rank{rank}", nbytes, step)

    def timeline(self, trace: Path, step: int) -> str | None:
        """Step `step`'s measured timeline, read from its trace file (`--trace-every`) as
        `pipelang viz --trace` reads it, as the image `timeline` at that step (without
        matplotlib, a text `timeline` naming the file); the warning to print where the
        file does not read."""
        from pipelang.trace import TraceError
        from pipelang.visualize.measured import read_trace

        try:
            panel = read_trace(trace).panel()
        except TraceError as err:
            return f"warning: no timeline for --tensorboard at step {step}: {err}"
        image = _png(panel)
        if image is None:
            self.writer.add_text("timeline", f"`pipelang viz --trace {trace}` draws it", step)
        else:
            self.writer.add_image("timeline", image, step, dataformats="HWC")
        return None

    def close(self) -> None:
        self.writer.close()


def timeline_figure(directory: str, trace: str, step: int) -> str:
    """The measured timeline of the last step of the run that `--trace` wrote (as
    `pipelang viz --trace` draws it), to DIR/timeline.svg and, as TensorBoard's text
    `timeline` at `step`, a link to it (with matplotlib, also its picture as the image
    `timeline`); the line the run prints."""
    from torch.utils.tensorboard import SummaryWriter

    from pipelang.trace import TraceError
    from pipelang.visualize import render
    from pipelang.visualize.measured import read_trace

    try:
        panel = read_trace(Path(trace)).panel()
    except TraceError as err:
        return f"warning: no timeline for --tensorboard: {err}"
    svg = Path(directory) / "timeline.svg"
    svg.write_text(str(render([panel], ".svg")))
    writer = SummaryWriter(directory)
    try:
        writer.add_text(
            "timeline",
            f"The measured timeline of the last step: [{svg.name}]({svg.name}) in this "
            f"directory (`pipelang viz --trace {trace} -o {svg.name}` draws it again).",
            step,
        )
        image = _png(panel)
        if image is not None:
            writer.add_image("timeline", image, step, dataformats="HWC")
    finally:
        writer.close()
    return f"wrote the measured timeline to {svg} and TensorBoard's `timeline` in {directory}"


def _png(panel: Any) -> Any:
    """The panel drawn as a PNG, read back as an HWC array; None without matplotlib (or
    past what a PNG draws)."""
    import io

    from pipelang.visualize.png import MissingMatplotlib, TooLarge, render_png

    try:
        data = render_png([panel])
        from matplotlib import image
    except (MissingMatplotlib, TooLarge, ImportError):
        return None
    return image.imread(io.BytesIO(data), format="png")
