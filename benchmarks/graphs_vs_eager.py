"""Graph replay against eager steps on one GPU (issue 14, item 8), side by side in one run.

Both runners train 1F1B (D=4, N=8) on one GPU, every rank in this process, with Adam:

- eager: `pipelang run --backend local` (each rank a thread running its action list on a
  CUDA stream of its own, messages as device copies);
- graphs: `pipelang run --backend local --graphs` (the stream executor: every rank's
  stream program issued on CUDA streams for 3 eager steps, then one iteration of every
  rank captured as one CUDA graph and replayed).

Per micro-batch size (1, 4, 16; gpt:tiny and gpt:small) it gives the median step time of
each after warm-up (graphs: the replays), their ratio (the goal: graphs at least 3x at
small micro-batches), the capture time (the capturing step less a replay), the summed
kernel time of one replay from torch.profiler (the goal at large micro-batches: a replay
within 10% of it), and the peak memory against the data-slot plan.

    python benchmarks/graphs_vs_eager.py          # on a GPU: replaces its RESULTS.md section
    python benchmarks/graphs_vs_eager.py --smoke  # anywhere, 1 size, few steps; prints only

Without CUDA only `--smoke` runs (the graphs runner is then the CPU executor, no capture):
it checks that this script works, not how fast anything is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import torch

from pipelang.api import load_program
from pipelang.backends.config import RunConfig
from pipelang.backends.executor import GRAPH_WARMUP
from pipelang.backends.local import local_device, run_local
from pipelang.backends.models import plan_stages
from pipelang.backends.stream_executor import StreamExecutor
from pipelang.compiler import stream_program as lower_streams

try:
    from benchmarks.results import write_section
except ImportError:  # run as a script from the repository root
    from results import write_section  # type: ignore[no-redef]

SECTION = "## CUDA graphs: replay against eager steps (one GPU, local backend)"
PARAMS = {"D": "4", "N": "8"}


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    micro_batch_size: int
    eager_ms: float
    graphs_ms: float
    capture_ms: float | None
    kernel_ms: float | None
    peak_eager: int
    peak_graphs: int
    slot_bytes: int


def step_times(run: object) -> list[float]:
    """The seconds of every step `run(on_step)` reports."""
    seconds: list[float] = []
    run(lambda step, loss, s, *_: seconds.append(s))  # type: ignore[operator]
    return seconds


def kernel_ms(executor: StreamExecutor, replays: int = 3) -> float | None:
    """Summed device time of the kernels of one replay (torch.profiler), or None."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                executor.graph.replay()  # type: ignore[union-attr]
            torch.cuda.synchronize()
        total = sum(
            getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
            for e in prof.key_averages()
        )
        return float(total) / 1e3 / replays
    except Exception as err:  # the profiler's CUDA support varies; say so, go on
        print(f"  no kernel time: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def measure(model: str, micro_batch_size: int, steps: int) -> Row:
    program = load_program("1f1b", PARAMS)
    device = local_device()
    cuda = device.type == "cuda"
    config = RunConfig(
        model=model,
        backend="local",
        steps=steps,
        optimizer="adam",
        micro_batch_size=micro_batch_size,
    )
    shapes = plan_stages(config.spec, program.num_stages, None).shapes
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    eager = step_times(lambda on_step: run_local(program, config, shapes, on_step))
    peak_eager = torch.cuda.max_memory_allocated() if cuda else 0
    graphs_config = replace(config, graphs=True)
    executor = StreamExecutor(program, lower_streams(program, 1), graphs_config, shapes, 0, device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    graphs = step_times(executor.run)
    peak_graphs = torch.cuda.max_memory_allocated() if cuda else 0
    replayed = graphs[GRAPH_WARMUP + 1 :] or graphs[-1:]
    replay = statistics.median(replayed)
    capture = (graphs[GRAPH_WARMUP] - replay) * 1e3 if executor.graph is not None else None
    return Row(
        model,
        micro_batch_size,
        statistics.median(eager[GRAPH_WARMUP:] or eager[-1:]) * 1e3,
        replay * 1e3,
        capture,
        kernel_ms(executor) if cuda and executor.graph is not None else None,
        peak_eager,
        peak_graphs,
        sum(executor.allocated_bytes),
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| model | micro-batch | eager step ms | graph replay ms | replay speed-up "
        "| kernel time per step ms (replay / kernels) | capture ms | peak MiB eager / graphs "
        "| data slots KiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kernels = (
            "-" if r.kernel_ms is None else f"{r.kernel_ms:.2f} ({r.graphs_ms / r.kernel_ms:.2f}x)"
        )
        capture = "-" if r.capture_ms is None else f"{r.capture_ms:.0f}"
        lines.append(
            f"| {r.model} | {r.micro_batch_size} | {r.eager_ms:.2f} | {r.graphs_ms:.2f} "
            f"| {r.eager_ms / r.graphs_ms:.2f}x | {kernels} | {capture} "
            f"| {r.peak_eager / 2**20:.0f} / {r.peak_graphs / 2**20:.0f} "
            f"| {r.slot_bytes / 1024:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="1 size, few steps; print only")
    parser.add_argument("--steps", type=int, default=20, help="steps per runner (default 20)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(
            "no CUDA here: this benchmark measures a GPU; --smoke checks the script",
            file=sys.stderr,
        )
        return 2
    sizes = [(m, b) for m in ("gpt:tiny", "gpt:small") for b in (1, 4, 16)]
    if args.smoke:
        sizes = [("gpt:tiny", 1)]
    steps = GRAPH_WARMUP + 3 if args.smoke else max(args.steps, GRAPH_WARMUP + 3)
    began = time.perf_counter()
    rows = []
    for model, size in sizes:
        rows.append(measure(model, size, steps))
        print(f"  {model} micro-batch {size} done", file=sys.stderr, flush=True)
        if not args.smoke:  # each row as soon as it exists: a cut-off run keeps it
            write_section(SECTION, _section(rows, len(sizes), steps, began))
    print(table(rows))
    return 0


def _section(rows: list[Row], planned: int, steps: int, began: float) -> str:
    """The RESULTS.md section of the rows measured so far (of `planned`)."""
    so_far = "" if len(rows) == planned else f"; {len(rows)} of {planned} rows so far"
    return "\n".join(
        [
            SECTION,
            "",
            f"- Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
            f"Python {sys.version.split()[0]}",
            f"- Command: `python benchmarks/graphs_vs_eager.py` "
            f"({time.perf_counter() - began:.0f} s{so_far})",
            f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            f"- Setup: 1f1b D=4 N=8, Adam, fp32, {steps} steps per runner; medians after "
            f"{GRAPH_WARMUP} warm-up steps (graphs: over the replays after the capture)",
            "",
            table(rows),
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
