"""Run a stream program on the CPU, in an adversarial but legal order.

What `pipelang run --backend local --graphs` does on a machine without CUDA: every
process's `RankRuntime` lives in this process, and the stream program (pipelang/ir/streams.py)
decides what runs. Each iteration, `Interleaving` picks the next op among all the streams
that can move, at random by a seed: any order the record/wait events, the channels and
the allreduces allow, and nothing more. A GPU may run any of these orders; a program that
is right for all of them is right on the GPU.

Values live where the program says:

- a data slot is a static buffer, allocated once with the bytes the plan gives it
  (`slot_bytes`); a value crossing streams is copied in and out of it, and a slot is
  filled with NaN as soon as its value is dead (after its last read, and before the first
  write). A read that runs before its write, or after the slot was reused, reads NaN or
  another value, and `--check` fails;
- a saved slot stands for what a forward keeps for its backward; the runtime keeps the
  tensors (autograd's graph), the executor checks that every read finds the forward it
  names (else `StreamRace`) and counts the slots held;
- a transfer copies from the sender's slot to the receiver's when both ends run (a send
  and its receive run together, as NCCL's do); an allreduce sums its members' gradients
  when all of them run, in process order.

On a GPU (`run --backend local --graphs` where CUDA is) the same loop issues the ops
instead of running them: every stream of every process is a CUDA stream, `record` and
`wait` are CUDA events, a transfer is a device copy on the receiving stream after it
waits for the sending one (and the sending stream then waits for the copy), an allreduce
sums on its first member's stream. The first `GRAPH_WARMUP` steps run so, eagerly; then
one iteration of every rank is captured as one CUDA graph and each later step replays
it. Dead slots are not filled with NaN there: the CPU proves the order, the GPU runs it.
That path has not run on a GPU yet (tests/test_gpu.py holds its tests).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipelang.backends.config import RunConfig
from pipelang.backends.executor import GRAPH_WARMUP, action_call
from pipelang.backends.metrics import StepMetrics, combine
from pipelang.backends.models import Shapes
from pipelang.backends.rank_sync import clip_coefficient
from pipelang.backends.report import Outcome
from pipelang.backends.runtime import RankRuntime
from pipelang.backends.summation import tree_sum
from pipelang.backends.worker import OnStep, step_report
from pipelang.diagnostics import InternalError
from pipelang.ir import Program
from pipelang.ir.streams import (
    Interleaving,
    StreamOp,
    StreamProgram,
    random_choice,
    value_boundary,
    value_key,
)

CPU = torch.device("cpu")


class StreamRace(RuntimeError):
    """A read found another value in its slot than the one it names."""


class _NoTransport:
    """The executor moves every message itself; the runtime never calls this."""

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        raise InternalError("the stream executor moves messages itself")

    recv = allreduce = world_sum = send  # type: ignore[assignment]

    def end_step(self) -> None:
        pass


def value_shape(value: str, shapes: Shapes) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a data value (`pipelang.ir.streams.value_boundary`); of a sequence
    chunk's value, the whole sequence's (an upper bound, which sizes its slot)."""
    return shapes[value_boundary(value)]


def slot_bytes(program: StreamProgram, rank: int, shapes: Shapes) -> dict[str, int]:
    """Bytes of every data slot of `rank`: the largest value it ever holds."""
    sizes: dict[str, int] = {}
    for _, op in program.by_rank(rank):
        for access in op.writes:
            if access.slot.startswith("d"):
                shape, dtype = value_shape(access.value, shapes)
                nbytes = math.prod(shape) * dtype.itemsize
                sizes[access.slot] = max(sizes.get(access.slot, 0), nbytes)
    return sizes


@dataclass
class _Process:
    """One process's runtime, slots and what its slots hold now."""

    runtime: RankRuntime
    buffers: dict[str, torch.Tensor]
    holds: dict[str, str | None] = field(default_factory=dict)
    reads_left: Counter[tuple[str, str]] = field(default_factory=Counter)
    peak_saved: int = 0
    """The most forwards whose activations the runtime kept at once (its `saved`)."""


class StreamExecutor:
    """The processes of one run and the stream program they execute; see the module
    docstring. `seed` picks the interleaving of the first step (then seed + step)."""

    def __init__(
        self,
        program: Program,
        streams: StreamProgram,
        config: RunConfig,
        shapes: Shapes,
        seed: int,
        device: torch.device = CPU,
    ) -> None:
        self.program = program
        self.streams = streams
        self.config = config
        self.shapes = shapes
        self.seed = seed
        self.cuda = device.type == "cuda"
        self.cuda_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self.cuda_events: dict[tuple[int, int], torch.cuda.Event] = {}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured_losses: list[list[tuple[int, torch.Tensor]]] = []
        self.reads = [
            Counter((a.slot, a.value) for _, op in streams.by_rank(r) for a in op.reads)
            for r in range(streams.ranks)
        ]
        self.processes: list[_Process] = []
        self.stepping: list[StreamOp] = []
        """`step` ops that wait for the other ranks' (`--clip-grad`)."""
        world = program.num_ranks
        for process in range(streams.ranks):
            rank, replica = process % world, process // world
            runtime = RankRuntime(
                program, rank, config, _NoTransport(), device, None, shapes, replica
            )
            buffers = {
                slot: torch.empty(nbytes, dtype=torch.uint8, device=device)
                for slot, nbytes in slot_bytes(streams, process, shapes).items()
            }
            self.processes.append(_Process(runtime, buffers))

    @property
    def peak_saved(self) -> list[int]:
        """Per process, the most forwards the runtime kept activations of at once."""
        return [p.peak_saved for p in self.processes]

    @property
    def allocated_bytes(self) -> list[int]:
        """The data slots' bytes held by each process (what `slot_bytes` planned)."""
        return [sum(b.numel() for b in p.buffers.values()) for p in self.processes]

    def run(self, on_step: OnStep) -> Outcome:
        """Train `config.steps` steps; the same report as any backend's."""
        losses: list[float] = []
        start = time.perf_counter_ns()
        for p in self.processes:
            p.runtime.start_clock(start)
            if self.cuda:  # a timing event per action cannot go into a captured graph
                p.runtime.timed, p.runtime.gpu_events = False, None
        metrics: list[StepMetrics] = []
        for step in range(self.config.steps):
            began = time.perf_counter()
            busy = [p.runtime.busy_ns for p in self.processes]
            for p in self.processes:
                p.runtime.grad_norm = None
                p.runtime.begin_step(step)
                p.runtime.load_inputs(step)
                p.reads_left = Counter(self.reads[p.runtime.world_rank])
                for slot in p.buffers if not self.cuda else ():
                    self._poison(p, slot)
                p.holds = dict.fromkeys(p.holds)
            if not self.cuda:
                self.iteration(self.seed + step)
            elif step < GRAPH_WARMUP:
                self._on_gpu(lambda: self.iteration(self.seed))
            else:
                self._replay()
            ended = [p.runtime.end_step() for p in self.processes]
            seconds = time.perf_counter() - began
            reports = [
                step_report(p.runtime, step, mine, seconds, before)
                for p, mine, before in zip(self.processes, ended, busy, strict=True)
            ]
            n = self.program.num_microbatches * self.config.dp
            loss, _, measured = combine(reports, n)
            losses.append(loss)
            metrics.append(measured)
            on_step(step, loss, seconds, measured)
        if self.config.save_hf is not None:  # every step ran: each rank's shards
            from pipelang.backends.hf_save import write_rank

            for p in self.processes:
                write_rank(p.runtime)
        results = [p.runtime.result(self.config.check) for p in self.processes]
        for result, nbytes in zip(results, self.allocated_bytes, strict=True):
            result.slot_bytes = nbytes
        return Outcome(results, losses, metrics)

    def iteration(self, seed: int) -> None:
        """Run (on a GPU: issue) every op of the stream program once, in the order `seed`
        picks."""
        order = Interleaving(self.streams, clocks=False)
        for step in order.run(random_choice(seed, order)):
            ops = [self.streams.ops[i] for i in step]
            if ops[0].is_event:
                if self.cuda:
                    self._event(ops[0])
                continue  # on the CPU, ordering only: the interleaving obeyed it
            if ops[0].what.startswith(("signal", "wait")):
                if self.cuda:
                    self._meet(*ops)
                continue
            if ops[0].stream.startswith("send"):
                self._transfer(*ops)
            elif ops[0].stream.startswith("reduce"):
                self._allreduce(ops)
            else:
                self._compute(ops[0])

    # ---- the GPU: streams, events, one graph ------------------------------------------------

    def _stream(
        self, op: StreamOp, name: str | None = None
    ) -> contextlib.AbstractContextManager[object]:
        """Where `op`'s work goes (or its process's stream `name`): that CUDA stream on a
        GPU; on the CPU, here and now."""
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._cuda_stream(op.rank, name or op.stream))

    def _cuda_stream(self, rank: int, name: str) -> torch.cuda.Stream:
        key = (rank, name)
        if key not in self.cuda_streams:  # made once: warm-up and capture use the same
            self.cuda_streams[key] = torch.cuda.Stream()
        return self.cuda_streams[key]

    def _event(self, op: StreamOp) -> None:
        assert op.event is not None
        stream = self._cuda_stream(op.rank, op.stream)
        if op.what == "record":
            self.cuda_events.setdefault((op.rank, op.event), torch.cuda.Event()).record(stream)
        else:
            stream.wait_event(self.cuda_events[(op.rank, op.event)])

    def _meet(self, *ops: StreamOp) -> None:
        """Ops that run together (a send and its receive, an allreduce's members): on a
        GPU each of their streams waits for all the others, so what follows any of them
        follows all."""
        if not self.cuda:
            return
        streams = [self._cuda_stream(op.rank, op.stream) for op in ops]
        for stream in streams[1:]:
            streams[0].wait_stream(stream)
        for stream in streams[1:]:
            stream.wait_stream(streams[0])

    def _on_gpu(self, issue: Callable[[], None]) -> None:
        """Issue one iteration: every compute stream forks from the current stream (the
        inputs' copies; a capture's own stream) and joins it at the end; the program
        forks and joins every other stream from compute."""
        current = torch.cuda.current_stream()
        computes = [self._cuda_stream(r, "compute") for r in range(self.streams.ranks)]
        for compute in computes:
            compute.wait_stream(current)
        issue()
        for compute in computes:
            current.wait_stream(compute)

    def _replay(self) -> None:
        """Capture one iteration of every rank as one CUDA graph (once), and replay it;
        the losses are read from the tensors the capture made."""
        if self.graph is None:
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self._on_gpu(lambda: self.iteration(self.seed))
            self.captured_losses = [list(p.runtime.losses) for p in self.processes]
        self.graph.replay()
        torch.cuda.synchronize()
        for p, losses in zip(self.processes, self.captured_losses, strict=True):
            p.runtime.losses = list(losses)
            p.runtime.stepped = True  # the captured iteration ends with its `step`

    # ---- ops -------------------------------------------------------------------------------

    def _compute(self, op: StreamOp) -> None:
        with self._stream(op):
            self._run_compute(op)

    def _run_compute(self, op: StreamOp) -> None:
        p = self.processes[op.rank]
        rt = p.runtime
        for access in op.reads:
            if access.slot.startswith("d"):
                view = self._view(p, access.slot, access.value)
                rt.values[value_key(access.value)] = view.clone()
            elif p.holds.get(access.slot) != access.value:
                raise StreamRace(
                    f"`{op.what}` on {op.stream_name} reads saved slot {access.slot} for "
                    f"{access.value}, but it holds {p.holds.get(access.slot) or 'nothing'}"
                )
            self._read_done(p, access.slot, access.value)
        if op.what == "step":
            self._step(op)
        else:
            action_call(op.action()).run(rt)  # the executor's table
        for access in op.writes:
            if access.slot.startswith("d"):
                value = rt.values.pop(value_key(access.value))
                self._view(p, access.slot, access.value).copy_(value)
            p.holds[access.slot] = access.value
        p.peak_saved = max(p.peak_saved, sum(len(c.saved) for c in rt.copies.values()))

    def _step(self, op: StreamOp) -> None:
        """A rank's optimizer step. With tied weights or `--clip-grad` every rank's step
        waits for all the others (their sums are collectives): the last one to arrive
        sums, clips and updates them all, a rank's `step` being the last op of its
        iteration."""
        runtime = self.processes[op.rank].runtime
        norm = self.config.clip_grad is not None or self.config.logs_metrics
        if not norm and not runtime.tied:
            runtime.apply_updates()
            return
        self.stepping.append(op)
        if len(self.stepping) < len(self.processes):
            return
        ops, self.stepping = sorted(self.stepping, key=lambda o: o.rank), []
        runtimes = [self.processes[o.rank].runtime for o in ops]
        self._meet(*ops)
        if runtime.tied:
            tied = tree_sum([rt.tied.contribution() for rt in runtimes])
            for rt in runtimes:
                rt.tied.set(tied)
        if norm:
            total = tree_sum([rt.grad_square_sum() for rt in runtimes])
            for rt in runtimes:
                rt.grad_norm = total.sqrt()
        if self.config.clip_grad is not None:
            coefficient = clip_coefficient(total, self.config.clip_grad)
            for rt in runtimes:
                rt.scale_grads(coefficient)
        for rt in runtimes:
            rt.apply_updates()
        self._meet(*ops)

    def _transfer(self, send: StreamOp, recv: StreamOp) -> None:
        src, dst = self.processes[send.rank], self.processes[recv.rank]
        (read,), (write,) = send.reads, recv.writes
        self._meet(recv, send)  # the copy runs on the receiving stream, after the send's
        with self._stream(recv):
            self._view(dst, write.slot, write.value).copy_(self._view(src, read.slot, read.value))
        self._meet(send, recv)  # and the sending stream goes on after the copy
        dst.holds[write.slot] = write.value
        self._read_done(src, read.slot, read.value)

    def _allreduce(self, ops: list[StreamOp]) -> None:
        members = sorted(ops, key=lambda op: op.rank)
        copies = []
        for op in members:
            action = op.action()
            copies.append(self.processes[op.rank].runtime.copies[(action.stage, action.pipeline)])  # type: ignore[index]
        self._meet(*members)
        if not copies[0].trained:  # a stage without weights: nothing to sum
            return
        with self._stream(members[0]):
            parts = [copy.flat_gradients() for copy in copies]
            total = tree_sum([flat for flat, _ in parts])
            for op, copy, (_, grads) in zip(members, copies, parts, strict=True):
                with self._stream(op, "compute"):  # where the sum is used and freed
                    mine = torch.empty_like(total)
                mine.copy_(total)
                copy.set_gradients(mine, grads)
        self._meet(*members)

    # ---- slots -----------------------------------------------------------------------------

    def _view(self, p: _Process, slot: str, value: str) -> torch.Tensor:
        """`slot` as the tensor of `value` (a sequence chunk's value is that chunk's)."""
        _, mb, _, _, chunk = value_key(value)
        shape, dtype = p.runtime.shape_of(value_boundary(value), chunk, mb)
        nbytes = math.prod(shape) * dtype.itemsize
        return p.buffers[slot][:nbytes].view(dtype).view(shape)

    def _read_done(self, p: _Process, slot: str, value: str) -> None:
        p.reads_left[(slot, value)] -= 1
        if p.reads_left[(slot, value)] == 0 and p.holds.get(slot) == value:
            p.holds[slot] = None
            if slot in p.buffers and not self.cuda:
                self._poison(p, slot)

    def _poison(self, p: _Process, slot: str) -> None:
        """Fill a dead data slot with NaN (as float32, or the slot's largest dtype)."""
        buffer = p.buffers[slot]
        whole = buffer.numel() - buffer.numel() % 4
        buffer[:whole].view(torch.float32).fill_(math.nan)
