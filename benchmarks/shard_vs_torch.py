"""Steps/s of pipelang's 1F1B with FSDP2 (`--dp 2 --shard`) against
torch.distributed.pipelining's `Schedule1F1B` over FSDP2-wrapped stages (torchtitan's
recipe), the same model in the same 4 gloo processes, side by side in one run.

    python benchmarks/shard_vs_torch.py [--model gpt:tiny] [--steps 10] [--rounds 3]
        [--no-write]

D = 2 pipeline ranks x 2 data-parallel copies (process = copy * 2 + rank, as `pipelang
run --dp 2` numbers them), N micro-batches per copy and step, Adam (single-tensor, as
pipelang's), fp32, `torch.set_num_threads(1)` per process. Each copy trains on its own
micro-batches (`replica * N + m`, as pipelang's copies do). Three runners, built once in
every process:

- pipelang: the stdlib `1f1b` compiled with `--dp 2 --shard`, each process's action list
  on its `RankRuntime` as a `pipelang run --backend gloo --dp 2 --shard` rank runs it
  (`build_rank`, then `run_step` per step): the stage sharded whole (one `fully_shard`),
  gathered once per step (`gather`), its gradients reduce-scattered once after its last
  backward (`reduce_scatter`);
- torch (stage): a `PipelineStage` over the same stage module, `fully_shard` on it whole
  (the same wrapping as pipelang's), `reshard_after_forward=False`, `Schedule1F1B`
  (which turns FSDP2's gradient sync off for every micro-batch but the last backward),
  `torch.optim.Adam(foreach=False)`;
- torch (blocks): as torch (stage), but `fully_shard` on each layer first, then the
  stage (torchtitan's wrapping: one all-gather and reduce-scatter per layer).

Both reduce in SUM (gloo has no AVG reduce-scatter) and scale the loss by 1/(N K).
Timing: in rounds that alternate the runners' order, each runner does `--warmup`
steps, a barrier, then `--steps` timed steps; a block's time is the slowest process's
(from the barrier to its last step's end); steps/s is the median over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelang.api import compile_schedule
from pipelang.backends.config import RunConfig
from pipelang.backends.models import ModelSpec, plan_stages
from pipelang.backends.transport import DistTransport
from pipelang.backends.worker import build_rank, run_step
from pipelang.ir import Program

try:  # run as a script (python benchmarks/...) or as a module
    from benchmarks.results import write_section
except ImportError:
    from results import write_section  # type: ignore[no-redef]

SECTION = "## Sharded 1F1B: pipelang --dp 2 --shard against torch's Schedule1F1B + FSDP2 (issue 41)"
D, DP = 2, 2
WORLD = D * DP
TIMEOUT = 300.0
CPU = torch.device("cpu")
RUNNERS = ("pipelang", "torch (stage)", "torch (blocks)")


@dataclass(frozen=True, slots=True)
class Plan:
    program: str
    model: str
    microbatches: int
    micro_batch_size: int
    seq_len: int | None
    port: int
    warmup: int
    steps: int
    rounds: int
    out: str

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.seq_len, self.micro_batch_size)


class PipelangRunner:
    def __init__(self, plan: Plan, world_rank: int) -> None:
        program = Program.from_json(plan.program)
        replica, rank = divmod(world_rank, D)
        config = RunConfig(
            model=plan.model,
            seq_len=plan.seq_len,
            micro_batch_size=plan.micro_batch_size,
            optimizer="adam",
            backend="gloo",
            dp=DP,
            shard=True,
            timeout=TIMEOUT,
        ).for_program(program)
        shapes = plan_stages(config.spec, D, None).shapes
        transport = DistTransport(program, rank, CPU, TIMEOUT, replica, DP)
        self.rank = build_rank(program, rank, config, transport, CPU, None, shapes, replica)

    def step(self, step: int) -> float | None:
        losses = run_step(self.rank, step).losses
        return statistics.fmean(losses.values()) if losses else None


class TorchRunner:
    def __init__(self, plan: Plan, world_rank: int, mesh: Any, blocks: bool) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        replica, stage = divmod(world_rank, D)
        spec = plan.spec
        bounds = plan_stages(spec, D, None).bounds
        self.model = spec.build(layers=bounds[stage])
        module = self.model.stage_module(bounds[stage])
        shards = mesh["dp"]
        for layer in module if blocks else ():
            self._policy(fully_shard(layer, mesh=shards, reshard_after_forward=False))
        self._policy(fully_shard(module, mesh=shards, reshard_after_forward=False))
        self.stage = PipelineStage(module, stage, D, CPU, group=mesh["pp"].get_group())
        self.first, self.last = stage == 0, stage == D - 1
        self.first_mb, self.n = replica * plan.microbatches, plan.microbatches
        self.schedule = Schedule1F1B(self.stage, self.n, loss_fn=self.model.loss)
        self.optimizer = torch.optim.Adam(module.parameters(), lr=3e-3, foreach=False)

    @staticmethod
    def _policy(module: Any) -> None:
        module.set_force_sum_reduction_for_comms(True)  # SUM, which gloo has
        module.set_gradient_divide_factor(float(DP))  # the mean over the copies

    def step(self, step: int) -> float | None:
        batches = [self.model.batch(step, self.first_mb + m, CPU) for m in range(self.n)]
        args = (torch.cat([ids for ids, _ in batches]),) if self.first else ()
        target = torch.cat([t for _, t in batches]) if self.last else None
        losses: list[torch.Tensor] | None = [] if self.last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(torch.stack(losses).detach().mean()) if losses else None


def block(runner: Any, first: int, warmup: int, steps: int) -> tuple[float, float | None]:
    """`warmup` steps, a barrier, `steps` timed steps: the slowest process's seconds, and
    this process's last loss (None off the last stage)."""
    for step in range(first, first + warmup):
        runner.step(step)
    dist.barrier()
    start = time.perf_counter()
    loss = None
    for step in range(first + warmup, first + warmup + steps):
        loss = runner.step(step)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), loss


def rank_main(world_rank: int, plan: Plan) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=world_rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT)
    )
    mesh = init_device_mesh("cpu", (DP, D), mesh_dim_names=("dp", "pp"))
    runners: dict[str, Any] = {
        "pipelang": PipelangRunner(plan, world_rank),
        "torch (stage)": TorchRunner(plan, world_rank, mesh, blocks=False),
        "torch (blocks)": TorchRunner(plan, world_rank, mesh, blocks=True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    losses: dict[str, float | None] = {}
    done = dict.fromkeys(runners, 0)
    for index in range(plan.rounds):
        order = list(runners) if index % 2 == 0 else list(runners)[::-1]
        for name in order:
            took, loss = block(runners[name], done[name], plan.warmup, plan.steps)
            done[name] += plan.warmup + plan.steps
            seconds[name].append(took)
            losses[name] = loss
        if world_rank == 0:
            print(f"  round {index + 1}/{plan.rounds} done", file=sys.stderr, flush=True)
    gathered: list[Any] | None = [None] * WORLD if world_rank == 0 else None
    dist.gather_object((seconds, losses), gathered, dst=0)
    if world_rank == 0:
        Path(plan.out).write_bytes(pickle.dumps(gathered))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def render(
    args: argparse.Namespace, gathered: list[Any], wall: float, loads: tuple[float, float]
) -> str:
    seconds, _ = gathered[0]
    last_losses = [losses for _, losses in gathered[D - 1 :: D]]  # each copy's last stage
    rows = []
    base = args.steps / statistics.median(seconds["pipelang"])
    for name in RUNNERS:
        rates = [args.steps / s for s in seconds[name]]
        rate = statistics.median(rates)
        loss = ", ".join(f"{each[name]:.4f}" for each in last_losses if each.get(name) is not None)
        rows.append(
            f"| {name} | {rate:.2f} | {min(rates):.2f} to {max(rates):.2f} | "
            f"{rate / base:.2f} | {loss} |"
        )
    command = "python benchmarks/shard_vs_torch.py " + " ".join(sys.argv[1:])
    layers = len(plan_stages(ModelSpec(args.model, args.seq_len), D, None).bounds[0])
    return f"""{SECTION}

`{command.strip()}` ({datetime.date.today().isoformat()}; CPU, {platform.machine()}, 2
cores shared by the 4 processes and whatever else runs: load average {loads[0]:.1f} before,
{loads[1]:.1f} after; torch {torch.__version__}; gloo; {wall:.0f} s). {args.model},
1F1B at D = 2 with --dp 2 (4 processes), N = {args.n} micro-batches of
{args.micro_batch_size} per copy, sequence length {args.seq_len or "the model's"}, Adam, fp32;
{args.rounds} rounds of {args.warmup} + {args.steps} steps per runner. Steps/s: the median
over rounds of steps / the slowest process's time (range over rounds); relative to
pipelang; the last timed step's mean loss on each copy's last stage (each runner trains
its own copy of the same seeded weights on the same micro-batches for the same number
of steps, so these agree up to rounding).

| runner | steps/s | range | vs pipelang | last loss per copy |
|---|---:|---:|---:|---|
{chr(10).join(rows)}

pipelang and torch (stage) make the same collectives per step (one all-gather and one
reduce-scatter of the whole stage) around the same forwards and backwards; what differs
is the driver around them. torch (blocks) makes one of each per layer ({layers}
per stage here), and on gloo over the CPU with small tensors each collective's fixed
cost outweighs the overlap it buys. The ranges are wide where the machine is shared:
compare rows within one run only.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt:tiny")
    parser.add_argument("-n", type=int, default=4, help="micro-batches per copy and step")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    params = {"D": str(D), "N": str(args.n)}
    program = compile_schedule("1f1b", params, dp=DP, shard=DP).need_program()
    wall, before = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="shard-vs-torch-") as tmp:
        out = str(Path(tmp) / "seconds.pickle")
        plan = Plan(
            program.to_json(),
            args.model,
            args.n,
            args.micro_batch_size,
            args.seq_len,
            free_port(),
            args.warmup,
            args.steps,
            args.rounds,
            out,
        )
        mp.spawn(rank_main, args=(plan,), nprocs=WORLD, join=True)
        gathered = pickle.loads(Path(out).read_bytes())
    loads = (before, os.getloadavg()[0])
    text = render(args, gathered, time.perf_counter() - wall, loads)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
