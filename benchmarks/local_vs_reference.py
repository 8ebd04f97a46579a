"""The local backend against one process: steps/s, and saved activations per rank against
the simulator. These are issue 6's measurements for the GPU machine; the script runs on
the CPU too, where `local` runs its ranks one at a time on one thread.

On the device `local` uses (the GPU when there is one, else the CPU):

1. Speed. Each schedule trains the model for `--warmup` + `--steps` steps with the
   `local` backend, and the same model, micro-batches and optimizer train in one process
   without a pipeline (`backends/reference.py`, the `--check` oracle), in `--rounds`
   rounds: each round runs every schedule beside its reference, alternating which goes
   first, so zb-h1 and 1F1B are measured side by side (the line under the table: zb-h1's
   ratio over 1F1B's, round by round). Steps/s from the median timed step. On one
   device a pipeline cannot beat one process (its ranks share the device); the ratio is
   what running the schedule as per-rank programs costs (actions, stage copies, the
   hand-over between ranks, on CUDA the streams and events).
2. Memory. A run with `count_activations` gives each rank's peak bytes of saved
   activations (backends/stash.py: the tensors autograd saves, not weights, not a
   stage's output; after a split backward's B, only what W reads and the gradients it
   starts from; a W right after its B runs with it as one whole backward, keeping
   nothing). The expectation for a rank is `pipelang simulate --model`'s
   (`measure.activation_peaks`: each stage's bytes and W's share, held along the
   rank's order by the one counter), for 1F1B and the schedules that split W off B, on
   `--memory-models`. Issues 6's and 33's bar is 10%; issue 33 also asks for zb-h1's
   largest rank within 1.1x of 1F1B's (the last table). That holds where the stages are
   alike, the paper's premise; a model entry `MODEL=L0-L1-L2-L3` also measures 1f1b,
   zb-h1 and zb-h2 with that partition of its layers (docs/runtime.md, "Memory of split
   schedules").

On CUDA the memory table also gives the process's `torch.cuda.max_memory_allocated`.

    python benchmarks/local_vs_reference.py             # replaces its RESULTS.md section
    python benchmarks/local_vs_reference.py --no-write  # print only
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime

import torch

from pipelang.api import load_program
from pipelang.backends.config import RunConfig
from pipelang.backends.local import local_device, run_local
from pipelang.backends.measure import activation_peaks, stage_activation_bytes
from pipelang.backends.models import plan_stages
from pipelang.backends.reference import train_reference
from pipelang.ir import COMPUTE_KINDS, Program
from pipelang.sim.memory import peak, w_share

try:
    from benchmarks.results import write_section
except ImportError:  # run as a script from the repository root
    from results import write_section  # type: ignore[no-redef]

SECTION = "## Local backend against one process"
SPEED = (
    ("1f1b", {"D": 4, "N": 8}),
    ("chimera", {"D": 4, "N": 8}),
    ("interleaved-1f1b", {"D": 2, "N": 8, "v": 2}),
    ("zb-h1", {"D": 4, "N": 8}),
)
MEMORY = (
    ("1f1b", {"D": 4, "N": 8}),
    ("zb-h1", {"D": 4, "N": 8}),
    ("zb-h2", {"D": 4, "N": 8}),
    ("zbv", {"D": 4, "N": 8}),
    ("v-half", {"D": 4, "N": 8}),
)
"""1F1B and the schedules that split W off B: the runtime's peaks against the one
counter's (`simulate --model`)."""
PARTITIONED = MEMORY[:3]
"""The schedules of one stage per rank, measured again with an entry's own partition."""
MEMORY_MODELS = "gpt:tiny=3-2-1-2,gpt:small@1=5-4-4-1,benchmarks/models/softmax_gpt.py:model"
"""gpt:tiny's 3-2-1-2 is the embedding and two blocks, two, one, one and the head;
gpt:small's 5-4-4-1 is the embedding and four blocks, four, four, and its head (50,257
words) alone: a stage as large as four blocks."""


def label(name: str, params: dict[str, int]) -> str:
    return name + " " + " ".join(f"{k}={v}" for k, v in params.items())


def program_of(name: str, params: dict[str, int]) -> Program:
    return load_program(name, {k: str(v) for k, v in params.items()})


def pipelined(program: Program, config: RunConfig) -> tuple[list[float], list[int], list[float]]:
    """Step seconds and each rank's peak saved-activation bytes of one `local` run (with
    the schedule's partition), and this process's CPU seconds as each step ended."""
    config = config.for_program(program)
    shapes = plan_stages(config.spec, program.num_stages, config.partition).shapes
    seconds: list[float] = []
    cpu: list[float] = []

    def done(_step: int, _loss: float, took: float, *_: object) -> None:
        seconds.append(took)
        cpu.append(time.process_time())

    outcome = run_local(program, config, shapes, done)
    return seconds, [r.peak_activation_bytes for r in outcome.results], cpu


def timed(program: Program, config: RunConfig, warmup: int, local: bool) -> tuple[float, float]:
    """The median timed step's seconds, and the CPU seconds of a timed step (the
    process's CPU time over the timed steps, over their count), of the schedule on
    `local` or of one process (the steps' CPU time: that of the whole run less that
    of a run of the warm-up steps alone)."""
    steps = config.steps - warmup
    if local:
        seconds, _, cpu = pipelined(program, config)
        return statistics.median(seconds[warmup:]), (cpu[-1] - cpu[warmup - 1]) / steps
    n, device = program.num_microbatches, local_device()
    began = time.process_time()
    seconds = train_reference(config, n, device).step_seconds
    middle = time.process_time()
    train_reference(replace(config, steps=warmup), n, device)
    return statistics.median(seconds[warmup:]), (2 * middle - began - time.process_time()) / steps


def speed(config: RunConfig, warmup: int, rounds: int) -> tuple[list[str], str]:
    """The speed table's rows, and zb-h1's ratio over 1F1B's. Every round runs every
    schedule, each with its one-process reference right before or after it (the order
    alternates by round, the schedules' too); a schedule's ratios are the medians of
    its rounds' ratios, in wall time and in CPU time. On a shared machine the CPU time
    is the steadier: another process's load lengthens a step's wall time, not the
    CPU time it takes."""
    programs = [(label(name, params), program_of(name, params)) for name, params in SPEED]
    walls: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in programs}
    cpus: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in programs}
    for round_ in range(rounds):
        for name, program in programs if round_ % 2 == 0 else programs[::-1]:
            first = round_ % 2 == 0
            got = {local: timed(program, config, warmup, local) for local in (first, not first)}
            walls[name].append((got[True][0], got[False][0]))
            cpus[name].append((got[True][1], got[False][1]))
    rows = []
    ratio: dict[str, list[float]] = {}
    cuda = torch.cuda.is_available()  # the host's CPU time is not a GPU's: wall time there
    for name, program in programs:
        wall = [b / a for a, b in walls[name]]
        cpu = [b / a for a, b in cpus[name]]
        ratio[name] = wall if cuda else cpu
        a, b = (statistics.median(t[k] for t in walls[name]) for k in (0, 1))
        actions = sum(op.kind in COMPUTE_KINDS for rank in program.ranks for op in rank)
        rows.append(
            f"| {name} | {1 / a:.2f} | {1 / b:.2f} | {_spread(wall)} | "
            f"{_spread(cpu)} | {1e3 * (a - b) / actions:.3f} |"
        )
    zb, one = ratio[label(*SPEED[3])], ratio[label(*SPEED[0])]
    pairs = [z / o for z, o in zip(zb, one, strict=True)]
    side = (
        f"zb-h1 against 1F1B, side by side in this run ({'wall' if cuda else 'CPU time'}): "
        "local / one process "
        f"{statistics.median(zb):.2f} against {statistics.median(one):.2f}; zb-h1's ratio is "
        f"{_spread(pairs)} of 1F1B's (the median over the {rounds} rounds of each round's "
        "quotient, and their least and most)."
    )
    return rows, side


def _spread(values: list[float]) -> str:
    """The median of `values`, and their least and most: `0.78 (0.64-0.82)`."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def memory(
    config: RunConfig, partition: tuple[int, ...] | None = None
) -> tuple[list[str], list[str]]:
    """Per schedule and rank: the simulator's count, `simulate --model`'s bytes and the
    runtime's measured peak; and per schedule the largest rank's peak over 1F1B's. With
    `partition`, the schedules of one stage per rank cut the model that way."""
    counting = replace(config, steps=2, count_activations=True)
    rows, largest = [], {}
    stages: dict[int, list[tuple[int, int]]] = {}  # per stage count: measured once
    cut = "-".join(map(str, partition)) if partition else "even"
    model = f"{config.model} (B = {config.micro_batch_size})"
    for name, params in PARTITIONED if partition else MEMORY:
        program = replace(program_of(name, params), partition=partition)
        if local_device().type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        measured = pipelined(program, counting)[1]
        process = (
            f"{torch.cuda.max_memory_allocated() / 2**20:.1f}"
            if local_device().type == "cuda"
            else "-"
        )
        if program.num_stages not in stages:
            stages[program.num_stages] = stage_activation_bytes(
                config.spec, program.num_stages, partition
            )
        expected = activation_peaks(config.spec, program, program.costs, stages[program.num_stages])
        w = w_share(program)
        for rank, got in enumerate(measured):
            count = peak(program.ranks[rank], w)
            rows.append(
                f"| {model} | {cut} | {label(name, params)} | {rank} | {count:g} | "
                f"{expected[rank] / 2**10:.1f} | "
                f"{got / 2**10:.1f} | {100 * (got / expected[rank] - 1):+.1f}% | "
                f"{process if rank == 0 else ''} |"
            )
        largest[name] = max(measured)
    summary = [
        f"| {model} | {cut} | {name} | {largest[name] / 2**10:.1f} | "
        f"{largest[name] / largest['1f1b']:.2f} |"
        for name in largest
    ]
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", default="gpt:small" if cuda else "gpt:tiny")
    parser.add_argument("--micro-batch-size", type=int, default=8 if cuda else 4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (at least 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--memory-models",
        default=MEMORY_MODELS,
        help="the models whose saved activations are measured, comma-separated; "
        "MODEL@B measures it with micro-batches of B, MODEL=L0-L1-L2-L3 also with that "
        "partition of its layers (default: %(default)s)",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be at least 1")
    if not cuda:
        torch.set_num_threads(1)
    began = time.perf_counter()
    load = os.getloadavg()[0]
    config = RunConfig(
        model=args.model,
        backend="local",
        steps=args.warmup + args.steps,
        optimizer="sgd",
        micro_batch_size=args.micro_batch_size,
    )
    speed_rows, side = speed(config, args.warmup, args.rounds)
    memory_rows: list[str] = []
    largest_rows: list[str] = []
    if not args.no_write:  # the speed rows at once: a run cut off later keeps them
        partial = _section(args, load, began, speed_rows, side, [], [], partial=True)
        write_section(SECTION, partial)
    for entry in args.memory_models.split(","):
        entry, _, cut = entry.partition("=")
        model, _, size = entry.partition("@")
        batch = int(size) if size else args.micro_batch_size
        measured = replace(config, model=model, micro_batch_size=batch)
        for partition in (None, tuple(map(int, cut.split("-")))) if cut else (None,):
            rows, largest = memory(measured, partition)
            memory_rows += rows
            largest_rows += largest
    text = _section(args, load, began, speed_rows, side, memory_rows, largest_rows, partial=False)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


def _section(
    args: argparse.Namespace,
    load: float,
    began: float,
    speed_rows: list[str],
    side: str,
    memory_rows: list[str],
    largest_rows: list[str],
    partial: bool,
) -> str:
    """The RESULTS.md section of what is measured so far."""
    cuda = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if cuda else f"{os.cpu_count()}-core CPU, 1 thread"
    so_far = "; speed only so far, memory still running" if partial else ""
    argv = [a for a in sys.argv[1:] if a != "--no-write"]
    return "\n".join(
        [
            SECTION,
            "",
            f"- Device: {where} ({platform.machine()}); load average {load:.2f} before, "
            f"{os.getloadavg()[0]:.2f} after",
            f"- torch {torch.__version__}, Python {platform.python_version()}",
            f"- Command: `{' '.join(['python', 'benchmarks/local_vs_reference.py', *argv])}` "
            f"({(time.perf_counter() - began) / 60:.1f} min{so_far})",
            f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            f"- Speed: model `{args.model}`, micro-batches of {args.micro_batch_size}, SGD, "
            f"fp32; {args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed "
            "steps of every schedule and of one process beside it, alternating which runs "
            "first; steps/s from the median timed step; a ratio is the median of the "
            "rounds' ratios (in parentheses their least and most), of the median timed "
            "steps (wall) or of the timed steps' CPU time (on CUDA the host's alone). Memory: "
            f"{args.memory_models} (`@B`: micro-batches of B; `=`: also that partition "
            "of the layers), otherwise the same micro-batches, 2 steps.",
            "",
            "| schedule | local steps/s | one process steps/s | local / one process "
            "(wall) | local / one process (CPU time) | extra ms per compute action |",
            "|---|---|---|---|---|---|",
            *speed_rows,
            "",
            side,
            "",
            "Saved activations per rank (KiB): the simulator's `peak_activations` (a "
            "forward until its B, and where W is split off W's share until its W); "
            "expected = `pipelang simulate --model` (each stage's bytes and W's share "
            "measured as the runtime counts them, held along the rank's order); measured = "
            "the run's peak (backends/stash.py, after B only what W reads: "
            "backends/weight_split.py).",
            "",
            "| model | partition | schedule | rank | simulator count | expected | measured | "
            "error | process peak MiB (CUDA) |",
            "|---|---|---|---|---|---|---|---|---|",
            *memory_rows,
            "",
            "The largest rank's measured peak, against 1F1B's largest on the same partition:",
            "",
            "| model | partition | schedule | largest rank's peak KiB | over 1F1B's |",
            "|---|---|---|---|---|",
            *largest_rows,
            "",
        ]
    )


if __name__ == "__main__":
    main()
