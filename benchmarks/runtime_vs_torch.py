"""Runtime speed: pipelang's gloo backend against torch.distributed.pipelining, in one run.

Both runtimes train the same model, split the same way, on the same data with the same
optimizer, in the same 4 gloo processes (one per rank, `torch.set_num_threads(1)` each):

- torch: a `PipelineStage` per stage (the stage module is pipelang's own slice of the
  model), `Schedule1F1B` (1 stage per rank) and `ScheduleInterleaved1F1B` (2 stages per
  rank, loop placement), the loss as `loss_fn` on the last stage, `torch.optim.SGD`;
- pipelang: the stdlib `1f1b` and `interleaved-1f1b` (v=2) programs as `pipelang run
  --backend gloo` runs them: each rank's generated stream program on a
  `StreamRankRuntime` (receives posted early as irecvs, data in static slots), `build_rank`
  then `run_step` per step, pipelang's SGD;
- actions: the same programs as rank action lists on a `RankRuntime` (blocking receives
  when a value is needed), what the `local` backend and schedules with evictions run.

D=4, N=8 micro-batches of 4x32 tokens, SGD (lr 0.05, momentum 0.9), fp32. Models:
`gpt:tiny`, and the same 8 layers at width 16 (`nano_gpt`), whose compute is smaller.

Timing. Every runner is built first (process start, model build, torch's shape inference
and pipelang's channel set-up are not timed). Then, in rounds that alternate which
runtime goes first, each runner does `--warmup` steps, a barrier and `--steps` timed
steps. A step's wall time runs from the moment the last rank finished the previous step
to the moment the last rank finished this one (ranks share CLOCK_MONOTONIC); the table
gives the median over all timed steps.

Host overhead per action. Each rank measures its main thread's CPU time
(`time.thread_time_ns`) over a step and, instrumented identically in both runtimes, the
part spent in compute (stage forward, loss, `torch.autograd.backward`), in the synthetic
data (`LayeredModel.batch`) and in the optimizer (step, zero_grad). Overhead = step CPU
minus those, summed over the ranks, divided by the F and B actions (2*N*v per rank in
both runtimes; sends and receives count as overhead). The part inside torch.distributed
point-to-point calls and their waits is shown apart. CPU time, not wall time: 4 ranks
share 2 cores (and the machine may be shared), so wall time mostly measures waiting for
a core or a peer. The wall time per compute action (the "tiny model" estimate) is shown
for comparison.

    python benchmarks/runtime_vs_torch.py             # ~2 min; replaces its RESULTS.md section
    python benchmarks/runtime_vs_torch.py --no-write  # print only
    python benchmarks/runtime_vs_torch.py --quick     # smoke test: 1 round of 3 steps
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
import torch.multiprocessing as mp
from torch import nn

import pipelang
from pipelang.api import load_program
from pipelang.backends import optim as pipelang_optim
from pipelang.backends.builtin_models import GPTConfig, gpt_layers
from pipelang.backends.config import DEFAULT_LR, SGD_MOMENTUM, RunConfig
from pipelang.backends.models import LayeredModel, ModelSpec
from pipelang.backends.stream_runtime import StreamRankRuntime
from pipelang.backends.transport import DistTransport
from pipelang.backends.worker import build_rank, run_step
from pipelang.compiler import stream_program as lower_streams
from pipelang.ir import Program

try:
    from benchmarks.results import RESULTS, write_section
except ImportError:  # run as a script from the repository root
    from results import RESULTS, write_section  # type: ignore[no-redef]
SECTION = "## Runtime: pipelang gloo vs torch.distributed.pipelining"
WORLD = 4
MICROBATCHES = 8
MICRO_BATCH_SIZE = 4
TIMEOUT = 120.0
CPU = torch.device("cpu")

NANO = GPTConfig(vocab=256, width=16, heads=2, blocks=6, seq_len=32)


def nano_gpt() -> nn.Sequential:
    """gpt:tiny's 8 layers at width 16 (2 heads): less compute per action."""
    model = nn.Sequential(*gpt_layers(NANO, NANO.seq_len))
    model.vocab_size = NANO.vocab
    model.seq_len = NANO.seq_len
    return model


NANO_LABEL = "nano (width 16)"
MODELS = {"gpt:tiny": "gpt:tiny", NANO_LABEL: f"{Path(__file__).stem}:nano_gpt"}
"""Table label -> `--model` name (nano is a `module:callable` user model)."""


@dataclass(frozen=True, slots=True)
class Case:
    """One schedule under both runtimes: torch's class name, pipelang's stdlib name."""

    torch_name: str
    pipe: str
    stages_per_rank: int

    @property
    def params(self) -> dict[str, str]:
        params = {"D": str(WORLD), "N": str(MICROBATCHES)}
        return params | ({"v": str(self.stages_per_rank)} if self.stages_per_rank > 1 else {})


CASES = (Case("Schedule1F1B", "1f1b", 1), Case("ScheduleInterleaved1F1B", "interleaved-1f1b", 2))
RUNTIMES = ("torch", "pipelang", "actions")


# ---- instrumentation (identical for both runtimes) -----------------------------------------


class Meter:
    """Main-thread CPU nanoseconds spent in compute, data and optimizer so far."""

    compute = 0
    data = 0
    optimizer = 0
    comm = 0
    """In torch.distributed point-to-point calls and their waits (part of the overhead)."""

    @classmethod
    def snapshot(cls) -> tuple[int, int, int, int]:
        return cls.compute, cls.data, cls.optimizer, cls.comm


def _timed(fn: Callable[..., Any], bucket: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(Meter, bucket, getattr(Meter, bucket) + time.thread_time_ns() - start)

    return timed


def install_meter() -> None:
    """Count the compute both runtimes call the same way: autograd, loss, data, pipelang's
    SGD (torch's optimizer is timed by its runner; stage forwards by `_time_forward`)."""
    torch.autograd.backward = _timed(torch.autograd.backward, "compute")
    LayeredModel.loss = _timed(LayeredModel.loss, "compute")  # type: ignore[method-assign]
    LayeredModel.batch = _timed(LayeredModel.batch, "data")  # type: ignore[method-assign]
    sgd = pipelang_optim.SGD
    sgd.step = _timed(sgd.step, "optimizer")  # type: ignore[method-assign]
    sgd.zero_grad = _timed(sgd.zero_grad, "optimizer")  # type: ignore[method-assign]
    # Communication: pipelang's transports and torch's batched P2P helpers, with their waits.
    for name in ("send", "recv", "end_step"):
        setattr(DistTransport, name, _timed(getattr(DistTransport, name), "comm"))
    for name in ("send", "recv", "wait_event", "signal", "wait_signal"):
        setattr(StreamRankRuntime, name, _timed(getattr(StreamRankRuntime, name), "comm"))
    for name in ("_batch_p2p", "_wait_batch_p2p"):
        setattr(torch_schedules, name, _timed(getattr(torch_schedules, name), "comm"))


def _time_forward(module: nn.Module) -> nn.Module:
    module.forward = _timed(module.forward, "compute")  # type: ignore[method-assign]
    return module


# ---- the two runners ------------------------------------------------------------------------


class TorchRunner:
    """This rank's stages under torch.distributed.pipelining (loop placement)."""

    def __init__(self, case: Case, model_name: str, rank: int) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        self.model = ModelSpec(model_name, None, MICRO_BATCH_SIZE).build()
        num_stages = WORLD * case.stages_per_rank
        bounds = self.model.stage_bounds(num_stages, None)
        held = [rank + WORLD * k for k in range(case.stages_per_rank)]
        stages = [
            PipelineStage(_time_forward(self.model.stage_module(bounds[s])), s, num_stages, CPU)
            for s in held
        ]
        self.first, self.last = 0 in held, num_stages - 1 in held
        params = [p for stage in stages for p in stage.submod.parameters()]
        self.optimizer = torch.optim.SGD(
            params, lr=DEFAULT_LR["sgd"], momentum=SGD_MOMENTUM, foreach=False
        )
        model = self.model

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return model.loss(logits, targets)  # mean CE; scale_grads divides by N

        if case.stages_per_rank == 1:
            self.schedule: Any = Schedule1F1B(stages[0], MICROBATCHES, loss_fn=loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss_fn)
        lowered = getattr(self.schedule, "pipeline_order_with_comms", None)
        self.actions = len(lowered[rank]) if lowered else None
        """Actions per step in torch's lowered program (None: a hand-written loop)."""

    def step(self, step: int) -> float | None:
        """One training step; the mean micro-batch loss on the rank with the last stage."""
        needed = self.first or self.last
        batches = [self.model.batch(step, mb, CPU) for mb in range(MICROBATCHES)] if needed else []
        args = (torch.cat([ids for ids, _ in batches]),) if self.first else ()
        target = torch.cat([t for _, t in batches]) if self.last else None
        losses: list[torch.Tensor] | None = [] if self.last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        start = time.thread_time_ns()
        self.optimizer.step()
        self.optimizer.zero_grad()
        Meter.optimizer += time.thread_time_ns() - start
        return float(torch.stack(losses).detach().mean()) if losses else None


class PipelangRunner:
    """This rank's generated program, as a gloo rank runs it: its stream program (the
    default), or its action list."""

    def __init__(self, program: Program, model_name: str, rank: int, streams: bool) -> None:
        config = RunConfig(
            model=model_name, optimizer="sgd", micro_batch_size=MICRO_BATCH_SIZE, timeout=TIMEOUT
        )
        transport = DistTransport(program, rank, CPU, TIMEOUT)
        lowered = lower_streams(program, 1) if streams else None
        self.rank = build_rank(program, rank, config, transport, CPU, None, streams=lowered)
        self.runtime = self.rank.runtime
        for copy in self.runtime.copies.values():
            _time_forward(copy.module)
        self.actions: int | None = len(self.rank.calls)
        """Calls per step: stream ops, or actions."""

    def step(self, step: int) -> float | None:
        losses = run_step(self.rank, step).losses
        return statistics.fmean(losses.values()) if losses else None


Runner = TorchRunner | PipelangRunner
Key = tuple[str, str, str]
"""(stdlib schedule name, model label, runtime)."""


# ---- one rank process -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """What every rank process is told: the compiled programs and how long to time."""

    programs: dict[str, str]
    """stdlib schedule name -> compiled Program (JSON)."""
    port: int
    warmup: int
    steps: int
    rounds: int
    out: str


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed step on one rank: when it ended, and its main-thread CPU time by part."""

    step: int
    end_ns: int
    cpu_ns: int
    compute_ns: int
    data_ns: int
    optimizer_ns: int
    comm_ns: int
    loss: float | None


@dataclass(frozen=True, slots=True)
class Block:
    """Consecutive timed steps of one runner on one rank, after a barrier at `start_ns`."""

    start_ns: int
    samples: list[Sample]


def run_order(round_index: int) -> list[Key]:
    """Every runner once; which runtime goes first alternates between rounds."""
    runtimes = RUNTIMES if round_index % 2 == 0 else RUNTIMES[::-1]
    return [(c.pipe, m, r) for c in CASES for m in MODELS for r in runtimes]


def build_runners(plan: Plan, rank: int) -> dict[Key, Runner]:
    """Every (schedule, model, runtime) runner of this rank, in the same order on every rank
    (building a runner creates process groups, a collective)."""
    runners: dict[Key, Runner] = {}
    for case in CASES:
        program = Program.from_json(plan.programs[case.pipe])
        for label, model_name in MODELS.items():
            runners[(case.pipe, label, "torch")] = TorchRunner(case, model_name, rank)
            for runtime in RUNTIMES[1:]:
                runners[(case.pipe, label, runtime)] = PipelangRunner(
                    program, model_name, rank, streams=runtime == "pipelang"
                )
    return runners


def measure(runner: Runner, first_step: int, warmup: int, steps: int) -> Block:
    """`warmup` untimed steps, a barrier, then `steps` timed ones."""
    for step in range(first_step, first_step + warmup):
        runner.step(step)
    dist.barrier()
    start = time.perf_counter_ns()
    samples = []
    for step in range(first_step + warmup, first_step + warmup + steps):
        before = Meter.snapshot()
        cpu = time.thread_time_ns()
        loss = runner.step(step)
        cpu = time.thread_time_ns() - cpu
        end = time.perf_counter_ns()
        parts = (a - b for a, b in zip(Meter.snapshot(), before, strict=True))
        samples.append(Sample(step, end, cpu, *parts, loss))
    return Block(start, samples)


def rank_main(rank: int, plan: Plan) -> None:
    """One of the WORLD processes: build every runner, time them in rounds, report."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port))
    torch.set_num_threads(1)
    wait = timedelta(seconds=TIMEOUT)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=wait)
    install_meter()
    runners = build_runners(plan, rank)
    done = dict.fromkeys(runners, 0)
    blocks: dict[Key, list[Block]] = {key: [] for key in runners}
    for round_index in range(plan.rounds):
        for key in run_order(round_index):
            blocks[key].append(measure(runners[key], done[key], plan.warmup, plan.steps))
            done[key] += plan.warmup + plan.steps
        if rank == 0:
            print(f"  round {round_index + 1}/{plan.rounds} done", file=sys.stderr, flush=True)
    actions = {key: runner.actions for key, runner in runners.items()}
    gathered: list[Any] | None = [None] * WORLD if rank == 0 else None
    dist.gather_object((blocks, actions), gathered, dst=0)
    if rank == 0:
        Path(plan.out).write_bytes(pickle.dumps(gathered))
    dist.destroy_process_group()


# ---- summary --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One runner's medians over all its timed steps; CPU figures are summed over the ranks."""

    step_ms: float
    step_ms_iqr: tuple[float, float]
    overhead_us: float
    """Main-thread CPU outside compute, data and optimizer, per compute action."""
    comm_us: float
    """The part of `overhead_us` inside torch.distributed point-to-point calls and waits."""
    compute_ms: float
    """Main-thread CPU in compute per step."""
    losses: dict[int, float]
    actions: int | None
    """Actions per step of the lowered programs (None: torch's hand-written 1F1B loop)."""
    compute_actions: int
    """F and B per step."""

    @property
    def wall_per_action_us(self) -> float:
        """The tiny-model estimate: step wall time over one rank's compute actions."""
        return self.step_ms * 1e3 / (self.compute_actions / WORLD)

    @property
    def own_us(self) -> float:
        """Overhead outside the point-to-point calls: the runtime's own code."""
        return self.overhead_us - self.comm_us


def summarize(
    gathered: list[tuple[dict[Key, list[Block]], dict[Key, int | None]]], key: Key
) -> Row:
    """Step wall time from the ranks' step ends; CPU overhead per compute action."""
    case = next(c for c in CASES if c.pipe == key[0])
    compute_actions = WORLD * 2 * MICROBATCHES * case.stages_per_rank
    step_ms, overhead, comm, compute, losses = [], [], [], [], {}
    for b, block in enumerate(gathered[0][0][key]):
        ranks = [blocks[key][b] for blocks, _ in gathered]
        previous = max(r.start_ns for r in ranks)
        for i in range(len(block.samples)):
            samples = [r.samples[i] for r in ranks]
            end = max(s.end_ns for s in samples)
            step_ms.append((end - previous) / 1e6)
            previous = end
            outside = sum(s.cpu_ns - s.compute_ns - s.data_ns - s.optimizer_ns for s in samples)
            overhead.append(outside / 1e3 / compute_actions)
            comm.append(sum(s.comm_ns for s in samples) / 1e3 / compute_actions)
            compute.append(sum(s.compute_ns for s in samples) / 1e6)
            losses.update({s.step: s.loss for s in samples if s.loss is not None})
    quartiles = statistics.quantiles(step_ms, n=4)
    counts = [actions[key] for _, actions in gathered]
    return Row(
        statistics.median(step_ms),
        (quartiles[0], quartiles[2]),
        statistics.median(overhead),
        statistics.median(comm),
        statistics.median(compute),
        losses,
        None if None in counts else sum(c for c in counts if c is not None),
        compute_actions,
    )


def table(rows: dict[Key, Row]) -> str:
    """The markdown table, one line per (schedule, model, runtime)."""
    lines = [
        "| schedule | model | runtime | steps/s | step ms, median (IQR) "
        "| host overhead per compute action, us CPU | of which in p2p calls "
        "| compute CPU per step, ms | wall per compute action, us "
        "| actions per step (compute) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (pipe, label, runtime), row in rows.items():
        case = next(c for c in CASES if c.pipe == pipe)
        name = {
            "torch": case.torch_name,
            "pipelang": f"`{pipe}` stream program",
            "actions": f"`{pipe}` action lists",
        }[runtime]
        low, high = row.step_ms_iqr
        lines.append(
            f"| {case.torch_name.removeprefix('Schedule')} | {label} | {runtime}: {name} "
            f"| {1e3 / row.step_ms:.2f} | {row.step_ms:.1f} ({low:.1f}-{high:.1f}) "
            f"| {row.overhead_us:.0f} | {row.comm_us:.0f} | {row.compute_ms:.1f} "
            f"| {row.wall_per_action_us:.0f} | {row.actions or 'loop'} ({row.compute_actions}) |"
        )
    return "\n".join(lines)


def ratios(rows: dict[Key, Row]) -> list[str]:
    """pipelang (both runtimes) / torch per schedule and model: overhead, step time, loss
    agreement."""
    out = []
    for case in CASES:
        for label in MODELS:
            theirs = rows[(case.pipe, label, "torch")]
            for runtime in RUNTIMES[1:]:
                ours = rows[(case.pipe, label, runtime)]
                common = sorted(set(ours.losses) & set(theirs.losses))
                gap = max(
                    (abs(ours.losses[k] - theirs.losses[k]) for k in common), default=math.nan
                )
                out.append(
                    f"- {case.torch_name.removeprefix('Schedule')}, {label}: {runtime}/torch "
                    f"host overhead {ours.overhead_us / theirs.overhead_us:.2f} (outside p2p "
                    f"calls {ours.own_us:.0f} vs {theirs.own_us:.0f} us, "
                    f"{ours.own_us / theirs.own_us:.2f}), step time "
                    f"{ours.step_ms / theirs.step_ms:.2f}; the losses of the {len(common)} "
                    f"timed steps agree to {gap:.1e}"
                )
    return out


def interpretation(rows: dict[Key, Row]) -> str:
    """The verdict against the issue's bar (no worse than torch) and goal (half of it)."""
    parts = []
    for case, runtime in [(c, r) for c in CASES for r in RUNTIMES[1:]]:
        ours, theirs = (rows[(case.pipe, NANO_LABEL, r)] for r in (runtime, "torch"))
        ratio = ours.overhead_us / theirs.overhead_us
        verdict = "no worse than" if ratio <= 1 else "worse than"
        goal = "meets" if ratio <= 0.5 else "misses"
        parts.append(
            f"On {case.torch_name.removeprefix('Schedule')} (nano model) {runtime}'s host "
            f"overhead per compute action is {ratio:.2f}x torch's ({ours.overhead_us:.0f} vs "
            f"{theirs.overhead_us:.0f} us of CPU): {verdict} torch; it {goal} the goal of half."
        )
    ours = [rows[(c.pipe, NANO_LABEL, "pipelang")] for c in CASES]
    theirs = [rows[(c.pipe, NANO_LABEL, "torch")] for c in CASES]
    budget = [t.overhead_us / 2 - o.comm_us for o, t in zip(ours, theirs, strict=True)]
    parts.append(
        "Most of pipelang's overhead is gloo's point-to-point calls (the same library in "
        f"both; {' and '.join(f'{r.comm_us:.0f}' for r in ours)} us per compute action "
        f"against torch's {' and '.join(f'{r.comm_us:.0f}' for r in theirs)}): outside "
        f"them pipelang's own code costs {' and '.join(f'{r.own_us:.0f}' for r in ours)} us "
        f"against torch's {' and '.join(f'{r.own_us:.0f}' for r in theirs)}. With the "
        "gloo calls as they are, half of torch's overhead leaves pipelang's own code "
        f"{' and '.join(f'{b:.0f}' for b in budget)} us per compute action (one send and "
        "one receive per compute action on an inner rank go through the same library)."
    )
    for runtime in RUNTIMES[1:]:
        speed = [rows[(*k[:2], "torch")].step_ms / rows[k].step_ms for k in rows if k[2] == runtime]
        parts.append(
            f"In steps/s {runtime} is {min(speed):.2f}-{max(speed):.2f}x torch (medians; the "
            "table gives each spread)."
        )
    parts.append(
        "On this shared, oversubscribed machine the wall time per compute action "
        "(milliseconds) measures waiting for a core or a peer more than runtime code."
    )
    return " ".join(parts)


def render(args: argparse.Namespace, rows: dict[Key, Row], machine: dict[str, str]) -> str:
    """The RESULTS.md section."""
    command = " ".join(["python benchmarks/runtime_vs_torch.py", *sys.argv[1:]])
    return "\n".join(
        [
            SECTION,
            "",
            f"- Machine: {os.cpu_count()}-core CPU ({cpu_name()}), no GPU; "
            f"`sum(range(1000))` takes {machine['calibrate']} us; load before: "
            f"`{machine['before']}`; after: `{machine['after']}`",
            f"- torch {torch.__version__}, pipelang {pipelang.__version__}, "
            f"Python {sys.version.split()[0]}",
            f"- Command: `{command}` ({machine['seconds']} s wall)",
            f"- Date: {machine['date']}",
            f"- Setup: D={WORLD}, N={MICROBATCHES} micro-batches of {MICRO_BATCH_SIZE}x32 "
            f"tokens, SGD (lr 0.05, momentum 0.9), fp32; the same {WORLD} gloo processes "
            "(1 thread each) run every runner; "
            f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed steps) per "
            "runner, the runtime that goes first alternating; medians over the timed steps.",
            "- Method: host overhead = each rank's main-thread CPU time per step minus the CPU "
            "time inside compute (stage forward, loss, autograd backward), data and optimizer, "
            "measured the same way in both runtimes, summed over ranks and divided by the F "
            "and B actions (2*N*v per rank in both). CPU time, because 4 ranks share 2 cores: "
            "wall time per action (the tiny-model method, last-but-one column) is dominated "
            "by waiting for a core and for peers, not by runtime code.",
            "",
            table(rows),
            "",
            *ratios(rows),
            "",
            interpretation(rows),
            "",
        ]
    )


# ---- main -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shell(command: str) -> str:
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout.strip()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks per runner")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps")
    parser.add_argument("--no-write", action="store_true", help=f"do not update {RESULTS.name}")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 3, 1
    machine = {"before": shell("uptime"), "date": shell("date")}
    wall = time.perf_counter()
    programs = {c.pipe: load_program(c.pipe, c.params).to_json() for c in CASES}
    print(
        f"{WORLD} gloo ranks, {len(run_order(0))} runners, {args.rounds} rounds of "
        f"{args.warmup} + {args.steps} steps each",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="runtime-vs-torch-") as tmp:
        out = str(Path(tmp) / "samples.pickle")
        plan = Plan(programs, free_port(), args.warmup, args.steps, args.rounds, out)
        mp.spawn(rank_main, args=(plan,), nprocs=WORLD, join=True)
        gathered = pickle.loads(Path(out).read_bytes())
    rows = {key: summarize(gathered, key) for key in gathered[0][0]}
    machine["after"] = shell("uptime")
    machine["seconds"] = f"{time.perf_counter() - wall:.0f}"
    calibrate = min(timeit.repeat("sum(range(1000))", number=10_000, repeat=5)) / 10_000
    machine["calibrate"] = f"{calibrate * 1e6:.1f}"
    text = render(args, rows, machine)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
        print(f"updated {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
