"""One rank of a run: set up, train, report. Shared by every backend.

`worker_main` is the entry of a rank process that `pipelang run` started itself (gloo,
nccl): it reports to the launcher through a queue (steps, the final result, or the error)
and publishes where it is, (phase, step, action), in a shared array the launcher watches.
`run_torchrun_rank` is the same rank started by torchrun, with no launcher around it.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipelang.backends import trace_steps
from pipelang.backends.backend import BACKENDS
from pipelang.backends.config import RunConfig
from pipelang.backends.executor import (
    GRAPH_WARMUP,
    RankProgram,
    StreamRankProgram,
    action_call,
    stream_rank,
)
from pipelang.backends.hosts import HostsError, mismatch, read_hosts, this_host
from pipelang.backends.mesh import Grid
from pipelang.backends.metrics import StepMetrics, StepReport, combine
from pipelang.backends.models import Shapes
from pipelang.backends.rank_base import RankResult
from pipelang.backends.runtime import RankRuntime, peak_memory
from pipelang.backends.termination import Termination
from pipelang.backends.trace_steps import Events
from pipelang.backends.transport import DistTransport, PeerFailure, Transport, peer_failures
from pipelang.diagnostics import InternalError
from pipelang.ir import Program
from pipelang.ir.streams import StreamProgram

PHASE_STARTING, PHASE_SETUP, PHASE_RUNNING, PHASE_DONE, PHASE_FAILED = range(5)
"""The first entry of a rank's (phase, step, action) status."""


class OnStep(Protocol):
    """What the reporting process is told after each step: (i, mean loss, seconds,
    metrics) and, where `--trace-every` traces the step, every process's events in it
    (`trace_steps.step_events`)."""

    def __call__(
        self,
        i: int,
        loss: float,
        seconds: float,
        metrics: StepMetrics,
        events: Sequence[Events] | None = None,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Job:
    """What the launcher hands a rank process (picklable)."""

    program_json: str
    config: RunConfig
    rank: int
    store_host: str
    store_port: int
    run_dir: str
    threads: int
    shapes: Shapes
    env: dict[str, str]
    """The launcher's environment now (the forkserver's may be older)."""
    streams: str | None = None
    """The checked stream program's text (`StreamProgram.dump`) where the ranks run one."""


def rank_threads(num_ranks: int) -> int:
    """CPU threads of one rank process when all ranks share this machine."""
    return max(1, (os.cpu_count() or 1) // num_ranks)


def device_for(config: RunConfig, local_rank: int) -> torch.device:
    """The device of the rank process with LOCAL_RANK `local_rank` (`Backend.device`)."""
    return BACKENDS[config.backend].device(local_rank)


def build_rank(
    program: Program,
    rank: int,
    config: RunConfig,
    transport: Transport,
    device: torch.device,
    status: MutableSequence[int] | None,
    shapes: Shapes | None = None,
    replica: int = 0,
    streams: StreamProgram | None = None,
) -> RankProgram:
    """Program rank `rank` in data-parallel copy `replica` on its runtime: its action
    list on a `RankRuntime`, or where the run executes one (`backend.runs_streams`: the
    caller compiled it) its part of `streams` on a `StreamRankRuntime`, with the driver
    that warms up, captures and replays under `--graphs` (backends/executor.py)."""
    if streams is None:
        runtime = RankRuntime(program, rank, config, transport, device, status, shapes, replica)
        return RankProgram(runtime, [action_call(a) for a in program.ranks[rank]])
    from pipelang.backends.stream_runtime import StreamRankRuntime

    if not isinstance(transport, DistTransport):
        raise InternalError("a stream program runs over torch.distributed channels")
    part = stream_rank(program, streams, rank, device.type == "cuda")
    stream_rt = StreamRankRuntime(
        program,
        rank,
        config,
        transport,
        device,
        part.slots,
        part.actions,
        status,
        shapes,
        replica,
    )
    return StreamRankProgram(stream_rt, part.calls, GRAPH_WARMUP if config.graphs else None)


def run_step(rank: RankProgram, step: int) -> StepReport:
    """One training iteration; returns this rank's report of it (`step_report`)."""
    runtime = rank.runtime
    busy, events = runtime.busy_ns, len(runtime.gpu_events or ())
    traced = runtime.config.trace_every is not None and trace_steps.begin(runtime, step)
    runtime.grad_norm = None
    start = time.perf_counter()
    runtime.begin_step(step)
    rank.run(step)
    losses = runtime.end_step()
    report = step_report(runtime, step, losses, time.perf_counter() - start, busy, events)
    if traced:
        report = replace(report, events=trace_steps.take(runtime, events))
    return report


def step_report(
    runtime: RankRuntime,
    step: int,
    losses: dict[int, float],
    seconds: float,
    busy: int,
    events: int = 0,
) -> StepReport:
    """A rank's report of step `step`, which took `seconds` and computed `losses`: the
    step's metrics as this rank sees them (`metrics.py`); its busy time and GPU events
    were `busy` and `events` before the step."""
    norm = runtime.grad_norm
    if norm is not None and runtime.device.type == "cuda" and not runtime.config.logs_metrics:
        norm = None  # only --clip-grad took it: reading it would wait for the GPU
    lr = runtime.lr.lr(step)
    busy_ns = step_busy_ns(runtime, busy, events)
    peak = peak_memory(runtime.device)
    params, state = runtime.held_bytes()
    return StepReport(
        losses,
        seconds,
        lr,
        busy_ns,
        peak,
        None if norm is None else float(norm),
        params,
        runtime.grad_bytes,
        state,
    )


def step_busy_ns(runtime: RankRuntime, busy: int, events: int) -> int | None:
    """The rank's time in compute actions in the step just run, its busy time having been
    `busy` and its GPU events `events` before. On a GPU the time is the step's GPU
    time (as the summary's busy share), read where the metrics ask for it (waiting for
    the step's events); None where not measured (a captured graph has no events)."""
    if runtime.device.type != "cuda":
        return runtime.busy_ns - busy
    if runtime.gpu_events is None or not runtime.config.logs_metrics:
        return None
    mine = runtime.gpu_events[events:]
    for *_, end in mine:
        end.synchronize()
    actions = runtime.program.ranks[runtime.rank]
    ms = sum(b.elapsed_time(e) for _, i, b, e in mine if actions[i].kind.is_compute)
    return int(ms * 1e6)


def train(
    rank: RankProgram,
    config: RunConfig,
    done: Callable[[int, StepReport], None],
    termination: Termination | None = None,
) -> int | None:
    """The steps of a run on one rank: from `--resume`'s checkpoint if given, saving
    where `--save` asks; `done(i, report)` after the i-th step of this run.

    With `termination`, every rank stops after the first step at which any was asked
    to (SIGTERM), saving there under `--save`; returns that step (None: all ran)."""
    from pipelang.backends import checkpoint

    runtime = rank.runtime
    if config.resume is not None:
        runtime.load_checkpoint(config.resume)
    for i in range(config.run_steps):
        step = config.first_step + i
        done(i, run_step(rank, step))
        saved = checkpoint.saves_after(config, step + 1)
        if saved:
            checkpoint.write(runtime.held(), step + 1, config, runtime.program.name)
        last = i + 1 == config.run_steps
        if termination is not None and not last and termination.agreed(runtime.device):
            if config.save is not None and not saved:
                checkpoint.write(runtime.held(), step + 1, config, runtime.program.name)
            return step + 1
    if config.save_hf is not None:  # every step ran: this rank's shards of the model
        from pipelang.backends.hf_save import write_rank

        write_rank(runtime)
    return None


def describe(err: BaseException) -> str:
    """One line for an exception: `Type: message`."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def worker_main(job: Job, status: MutableSequence[int], queue: Any) -> None:
    """Entry of a rank process started by the launcher; never returns normally on error."""
    from pipelang.backends import checkpoint

    _die_with_parent()
    # from the start: a SIGTERM during set-up stops the run at its first step
    termination = Termination(status, len(status) - 1)  # and the launcher's own
    _redirect_output(Path(job.run_dir) / f"rank{job.rank}.log")
    os.environ.clear()
    os.environ.update(job.env)
    from pipelang.backends.model_import import trust

    trust(job.config.model)  # the launcher loaded it in a child already, and watches us
    slot = 3 * job.rank
    status[slot] = PHASE_SETUP
    status[slot + 1] = -1
    try:
        rank = _set_up(job, status)
        runtime = rank.runtime
        status[slot] = PHASE_RUNNING
        report = lambda *done: queue.put(("step", job.rank, *done))  # noqa: E731
        checkpoint.announce = lambda line: queue.put(("note", job.rank, line))
        stopped = train(rank, job.config, report, termination)
        result = runtime.result(job.config.check)
        result.stopped_after = stopped
        status[slot] = PHASE_DONE
        data = _to_bytes(result)
        del result  # --check's whole weights, in `data` now: not held beside its pickle
        queue.put(("done", job.rank, data))
        runtime.close()  # a captured graph goes before the process groups it uses
        dist.destroy_process_group()
    except BaseException as err:
        status[slot] = PHASE_FAILED
        secondary = isinstance(err, PeerFailure)
        queue.put(("error", job.rank, describe(err), traceback.format_exc(), secondary))
        queue.close()
        queue.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _set_up(job: Job, status: MutableSequence[int]) -> RankProgram:
    """Join the process group, open the channels, build the stages and the program."""
    config = job.config
    torch.set_num_threads(job.threads)
    program = Program.from_json(job.program_json)
    wait = timedelta(seconds=config.timeout)
    store = dist.TCPStore(job.store_host, job.store_port, None, False, timeout=wait)
    backend = BACKENDS[config.backend].dist
    grid = Grid(config.dp, program.num_ranks, config.tp)
    world = grid.world
    dist.init_process_group(backend, store=store, rank=job.rank, world_size=world, timeout=wait)
    device = device_for(config, job.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    replica, rank, tensor = grid.coords(job.rank)
    transport = DistTransport(
        program, rank, device, config.timeout, replica, config.dp, config.tp, tensor
    )
    streams = None if job.streams is None else StreamProgram.parse(job.streams)
    shapes = job.shapes
    built = build_rank(program, rank, config, transport, device, status, shapes, replica, streams)
    dist.barrier()
    built.runtime.start_clock()
    return built


def run_torchrun_rank(
    program: Program,
    config: RunConfig,
    on_step: OnStep,
    streams: StreamProgram | None = None,
) -> list[RankResult] | None:
    """This process is one rank under torchrun; rank 0 gets every rank's result.

    With `--dp K`, RANK is `replica * R + program rank` (WORLD_SIZE is K x R). The rank
    runs its part of `streams` where the ranks run a stream program (the caller compiled
    it), else its action list.
    """
    from pipelang.backends.torchrun_env import torchrun_env

    termination = Termination()  # from the start: SIGTERM in set-up stops at step 1
    env = torchrun_env()  # checked by the launch already: no traceback here
    rank, world, local_rank = env.rank, env.world, env.local_rank
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it; a hand-started rank may not
        torch.set_num_threads(rank_threads(env.local_world))
    wait = timedelta(seconds=config.timeout)
    backend = BACKENDS[config.backend].dist
    status = [0] * (3 * world)
    slot = 3 * rank
    status[slot], status[slot + 1] = PHASE_SETUP, -1
    try:
        with peer_failures():
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=wait)
    except PeerFailure as err:
        raise RankStopped(err, (PHASE_SETUP, -1, 0)) from err
    try:
        grid = Grid(config.dp, program.num_ranks, config.tp)
        if config.rank_hosts is not None:
            _check_hosts(config.rank_hosts, grid)
        device = device_for(config, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        replica, program_rank, tensor = grid.coords(rank)
        transport = DistTransport(
            program, program_rank, device, config.timeout, replica, config.dp, config.tp, tensor
        )
        built = build_rank(
            program, program_rank, config, transport, device, status, None, replica, streams
        )
        runtime = built.runtime
        with peer_failures():
            dist.barrier()
        runtime.start_clock()
        status[slot] = PHASE_RUNNING
        n = program.num_microbatches * config.dp
        done = _step_reports(n, rank, world, device, on_step if rank == 0 else None, tensor)
        stopped = train(built, config, done, termination)
        status[slot] = PHASE_DONE
        result = runtime.result(config.check)
        result.stopped_after = stopped
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        with peer_failures():
            dist.gather_object(result, gathered, dst=0)
        runtime.close()  # a captured graph goes before the process groups it uses
        return gathered if rank == 0 else None  # type: ignore[return-value]
    except (Exception, SystemExit) as err:  # sys.exit() in a model's forward: a failure
        place = (status[slot], status[slot + 1], status[slot + 2])
        raise RankStopped(err, place) from err  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


def _step_reports(
    n: int,
    rank: int,
    world: int,
    device: torch.device,
    on_step: OnStep | None,
    tensor: int = 0,
) -> Callable[[int, StepReport], None]:
    """What a rank under torchrun does after each step: its report to rank 0 in the
    step's one all-reduce, where the ranks' reports are combined (`metrics.combine`: the
    mean loss over the `n` micro-batches, the time, the metrics) for `on_step` (rank
    0's; None elsewhere). Under --tp every tensor rank computes the same losses: tensor
    rank 0's (`tensor`) count."""

    def done(i: int, report: StepReport) -> None:
        # one slot per micro-batch, filled by the one rank that computed its loss: the
        # sum is exact, and the mean adds them in micro-batch order, as --check does;
        # then per rank (seconds, busy ns or -1, peak memory, parameter, gradient and
        # optimizer bytes), filled by that rank alone (float64: bytes exact below 2**53)
        each = torch.zeros(n + 6 * world, dtype=torch.float64, device=device)
        for mb, loss in report.losses.items() if tensor == 0 else ():
            each[mb] = loss
        busy = -1 if report.busy_ns is None else report.busy_ns
        sizes = [report.peak_memory, report.param_bytes, report.grad_bytes, report.optimizer_bytes]
        mine = torch.tensor([report.seconds, busy, *sizes], dtype=torch.float64)
        each[n + 6 * rank : n + 6 * rank + 6] = mine
        with peer_failures():
            dist.all_reduce(each)
        traced = _gather_events(report, rank, world)
        if on_step is None:
            return
        values = each.tolist()
        reports = []
        for r in range(world):
            seconds, busy_ns, *held = values[n + 6 * r : n + 6 * r + 6]
            peak, params, grads, state = (int(v) for v in held)
            losses = dict(enumerate(values[:n])) if r == 0 else {}
            norm = report.grad_norm if r == 0 else None  # every rank took the same norm
            busy_or_none = None if busy_ns < 0 else int(busy_ns)
            reports.append(
                StepReport(
                    losses, seconds, report.lr, busy_or_none, peak, norm, params, grads, state
                )
            )
        loss, seconds, metrics = combine(reports, n)
        on_step(i, loss, seconds, metrics, traced)

    return done


def _gather_events(report: StepReport, rank: int, world: int) -> list[Events] | None:
    """Under torchrun, every rank's events of a step that `--trace-every` traces (every
    rank knows which), gathered to rank 0 (`trace_steps.step_events`); None elsewhere."""
    if report.events is None:
        return None
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    with peer_failures():
        dist.gather_object(report.events, gathered, dst=0)
    if gathered is None:
        return None
    return [tuple(events or ()) for events in gathered]


def _check_hosts(path: str, grid: Grid) -> None:
    """Every process's host against the `--rank-hosts` file, and each tensor group on
    one host (`Grid.hosts_problem`); raises HostsError on every process alike when one
    is elsewhere."""
    hosts = read_hosts(path)
    actual: list[Any] = [None] * grid.world
    with peer_failures():
        dist.all_gather_object(actual, this_host())
    problem = grid.hosts_problem(hosts, path) or mismatch(path, hosts, actual)
    if problem is not None:
        raise HostsError(problem)


class RankStopped(Exception):
    """A rank under torchrun failed: its error, and where (phase, step, action index), as
    the launcher's status array would say (`processes.where`)."""

    def __init__(self, cause: BaseException, place: tuple[int, int, int]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.place = place


def _to_bytes(result: RankResult) -> bytes:
    # Plain bytes: torch's shared-memory tensor passing would need this process alive.
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> RankResult:
    """Read back what a rank sent with `_to_bytes`."""
    result: RankResult = torch.load(io.BytesIO(data), weights_only=False)
    return result


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies: no orphan ranks."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _redirect_output(path: Path) -> None:
    """Send this rank's stdout and stderr (gloo's warnings too) to its log file."""
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
