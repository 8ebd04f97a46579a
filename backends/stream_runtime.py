"""`StreamRankRuntime`: what a rank's stream program (`--graphs`) calls, on CPU processes.

A rank of a gloo or nccl run issues its ops of the stream program in order, one call per
op (backends/executor.py, `stream_rank`). On the CPU there is one real stream, the host: a
compute op runs when it is issued. A channel or reduce stream is the list of
torch.distributed works issued on it and not yet waited:

- `recv` posts an `irecv` into its slot and returns; `send` starts an `isend` of its slot;
  `allreduce` starts an asynchronous allreduce of the copy's gradients;
- `record_event(e, on=S)` remembers how many works S has issued;
- `wait_event(e, on="compute")` waits for those works: this is where a receive's data is
  needed, or a sent slot is reused.

A record on the compute stream and a wait on any other stream need nothing here (the
host has run every compute op it issued), so a CPU process does not issue them
(`host_ops`).

On a GPU (nccl, one process per GPU) every stream is a CUDA stream, created on first use
and kept, so warm-up and capture use the same streams; `record_event`/`wait_event` are
CUDA events; a transfer or allreduce runs on its stream and makes that stream wait for
it (`Work.wait` inside the stream). The driver (`executor.StreamRankProgram`) warms up, captures
the whole iteration once (`torch.cuda.graph`, `thread_local` capture mode, optimizer
included) and replays it, under its own timeout: captured NCCL calls have none. This
CUDA path is written to the rules of ../shared/reference/cuda_graphs_nccl.md but has not
run on a GPU yet (tests/test_gpu.py holds its tests).

So receives are posted as early as the program allows (the `streams` pass issues them
so) and complete while the host computes. Values live in static slots (`d0`, ...; their
bytes from the model's shapes): a forward's input and a backward's incoming gradient
are copied out of their slot (autograd keeps them, and the slot will hold other values),
a result is copied into its slot.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from typing import Any

import torch

from pipelang.backends.config import RunConfig
from pipelang.backends.models import Shapes
from pipelang.backends.rank_base import RankResult, _action
from pipelang.backends.runtime import RankRuntime
from pipelang.backends.stage import Stage
from pipelang.backends.transport import DistTransport, PeerFailure, StepSum, peer_failures
from pipelang.diagnostics import InternalError
from pipelang.ir import Program
from pipelang.ir.streams import value_boundary, value_key

Slots = Mapping[str, tuple[int, ...]]
"""Slot name -> the stage boundaries whose values it holds (b: the output of stage b)."""


class StreamRankRuntime(RankRuntime):
    """The `rt` of a rank's stream program; see the module docstring."""

    def __init__(
        self,
        program: Program,
        rank: int,
        config: RunConfig,
        transport: DistTransport,
        device: torch.device,
        slots: Slots,
        actions: Sequence[int | None],
        status: MutableSequence[int] | None = None,
        shapes: Shapes | None = None,
        replica: int = 0,
    ) -> None:
        super().__init__(program, rank, config, transport, device, status, shapes, replica)
        self.channels = transport
        self.actions = actions
        """Per op of the iteration: the index of its action, None for an event."""
        self.reduced_at_step: list[Stage] = []  # the stream program reduces them itself
        self.slots = {
            name: torch.empty(max(_nbytes(self.shapes[b]) for b in bounds), dtype=torch.uint8)
            for name, bounds in slots.items()
        }
        self.issued: dict[str, list[Any]] = {}
        """Per stream: the works issued on it this iteration."""
        self.marks: dict[int, tuple[str, int]] = {}
        """Per event: its stream and how many works that stream had issued then."""
        self.graph: Any = None
        """The captured iteration: a torch.cuda.CUDAGraph, or on a CPU the function."""
        self.cuda = device.type == "cuda"
        self.streams: dict[str, torch.cuda.Stream] = {}
        self.cuda_events: dict[int, torch.cuda.Event] = {}
        self.captured_losses: list[tuple[int, torch.Tensor]] = []
        self.messages: dict[tuple[str, int], torch.Tensor] = {}
        """One-element signal buffers, one per direction and peer, kept for replays."""
        self.waited: dict[str, int] = {}
        """Per stream: how many of its works (from the first) are waited for."""
        self.views: dict[tuple[object, ...], torch.Tensor] = {}
        """(slot, stage boundary or value) -> the slot viewed as that value."""

    # ---- the driver: eager steps, one capture, replays -------------------------------------

    def run_eager(self, iteration: Callable[[RankRuntime], None]) -> None:
        """A warm-up step: the iteration as it is (on a GPU, on the compute stream the
        capture will use)."""
        if not self.cuda:
            iteration(self)
            return
        compute = self._stream("compute")
        compute.wait_stream(torch.cuda.current_stream(self.device))  # the inputs' copies
        with torch.cuda.stream(compute):
            iteration(self)
        torch.cuda.current_stream(self.device).wait_stream(compute)

    def capture(self, iteration: Callable[[RankRuntime], None]) -> None:
        """Capture the iteration for `replay`. On a CPU nothing is captured (there is no
        graph to capture into): the iteration is kept and every replay runs it."""
        if not self.cuda:
            self.graph = iteration
            return
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, stream=self._stream("compute"), capture_error_mode="thread_local"
        ):
            iteration(self)
        self.captured_losses = list(self.losses)
        self.losses.clear()
        self.graph = graph

    def replay(self) -> None:
        """Run the captured iteration once; on a GPU, wait for it under `--timeout`."""
        if self.graph is None:
            raise InternalError("replay before capture")
        if not self.cuda:
            self.graph(self)
            return
        self.graph.replay()
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.config.timeout
        while not done.query():
            if time.monotonic() > deadline:
                raise PeerFailure(
                    f"a replay of the captured iteration did not finish in "
                    f"{self.config.timeout:g} s (--timeout); captured NCCL calls have no "
                    "timeout of their own, so a peer that stopped shows here"
                )
            time.sleep(1e-4)
        self.losses = list(self.captured_losses)  # the graph rewrote these tensors
        self.stepped = True  # the captured iteration ends with its `step`

    def close(self) -> None:
        if self.cuda and self.graph is not None:
            torch.cuda.synchronize(self.device)
        self.graph = None

    def start_clock(self, t0: int | None = None, t0_event: torch.cuda.Event | None = None) -> None:
        super().start_clock(t0, t0_event)
        if self.cuda and self.config.graphs:  # a timing event cannot go into a captured graph
            self.timed, self.gpu_events = False, None

    def timed_call(
        self, index: int, method: Callable[..., None], args: Any, kwargs: dict[str, Any]
    ) -> None:
        """Time op `index` as the action it performs (`executor.StreamRank.actions`),
        so that a trace names actions as the action-list runtime's does; events untimed."""
        action = self.actions[index]
        if action is None:
            method(self, *args, **kwargs)
        else:
            super().timed_call(action, method, args, kwargs)

    def _stream(self, name: str) -> torch.cuda.Stream:
        if name not in self.streams:
            self.streams[name] = torch.cuda.Stream(self.device)
        return self.streams[name]

    def _on(self, stream: str, issue: Callable[[], Any]) -> None:
        """Issue a communication on `stream`: on a GPU, that stream waits for it; on a
        CPU, the work joins the stream's list for `wait_event`."""
        with peer_failures(_peer(stream)):
            if not self.cuda:
                self._issue(stream, issue())
                return
            with torch.cuda.stream(self._stream(stream)):
                issue().wait()

    def result(self, with_weights: bool) -> RankResult:
        report = super().result(with_weights)
        report.slot_bytes = sum(b.numel() for b in self.slots.values())
        return report

    def _view(
        self, slot: str, boundary: int, chunk: int | None = None, mb: int | None = None
    ) -> torch.Tensor:
        """`slot` as a tensor of the output of stage `boundary` (shape and dtype), of one
        sequence chunk's tokens when `chunk` is given, of micro-batch `mb`'s shape where
        they differ; made once (slots never move) and kept, since a view costs a few
        microseconds per op."""
        key = (slot, boundary, chunk, None if self.config.batch_shapes is None else mb)
        view = self.views.get(key)
        if view is None:
            shape, dtype = self.shape_of(boundary, chunk, mb)
            view = self.slots[slot][: _nbytes((shape, dtype))].view(dtype).view(shape)
            self.views[key] = view
        return view

    def _value_view(self, slot: str, value: str) -> torch.Tensor:
        view = self.views.get((slot, value))
        if view is None:
            _, mb, _, _, chunk = value_key(value)
            boundary = value_boundary(value)
            view = self.views[(slot, value)] = self._view(slot, boundary, chunk, mb)
        return view

    # ---- events ----------------------------------------------------------------------------

    @_action
    def record_event(self, event: int, on: str) -> None:
        """Mark what stream `on` has issued so far."""
        if self.cuda:
            self.cuda_events.setdefault(event, torch.cuda.Event()).record(self._stream(on))
            return
        self.marks[event] = (on, len(self.issued.get(on, ())))

    @_action
    def wait_event(self, event: int, on: str) -> None:
        """Make stream `on` wait for the event. On a CPU only the host (compute) blocks,
        and a stream's works are waited once each, in order (a gloo receive's `wait` is
        not idempotent: a second one waits for another message)."""
        if self.cuda:
            self._stream(on).wait_event(self.cuda_events[event])
            return
        if on != "compute" or event not in self.marks:
            return
        stream, upto = self.marks[event]
        start = self.waited.get(stream, 0)
        with peer_failures(_peer(stream)):
            for work in self.issued.get(stream, [])[start:upto]:
                work.wait()
        self.waited[stream] = max(start, upto)

    def _issue(self, stream: str, work: Any) -> None:
        self.issued.setdefault(stream, []).append(work)

    # ---- transfers -------------------------------------------------------------------------

    @_action
    def send(self, to: int, slot: str, value: str) -> None:
        """Start sending the value in `slot` to rank `to` (on stream `send{to}`)."""
        group, peer = self.channels.out[to]
        view = self._value_view(slot, value)
        self._on(f"send{to}", lambda: group.send([view], peer, 0))

    @_action
    def recv(self, src: int, slot: str, value: str) -> None:
        """Post the receive of `value` from rank `src` into `slot` (on stream `recv{src}`)."""
        group, peer = self.channels.into[src]
        view = self._value_view(slot, value)
        self._on(f"recv{src}", lambda: group.recv([view], peer, 0))

    @_action
    def send_signal(self, to: int) -> None:
        """Tell rank `to` an op finished (an `after` dependency): a one-element message."""
        group, peer = self.channels.out[to]
        message = self._message("to", to)
        self._on(f"send{to}", lambda: group.send([message], peer, 0))

    @_action
    def wait_signal(self, src: int) -> None:
        """Post the receive of rank `src`'s signal; the compute stream waits for it."""
        group, peer = self.channels.into[src]
        message = self._message("from", src)
        self._on(f"recv{src}", lambda: group.recv([message], peer, 0))

    def _message(self, direction: str, peer: int) -> torch.Tensor:
        key = (direction, peer)
        if key not in self.messages:
            self.messages[key] = torch.ones(1, device=self.device)
        return self.messages[key]

    @_action
    def allreduce(self, stage: int, pipeline: str) -> None:
        """Start summing this copy's gradients over the stage's replicas (`reduce{stage}`)."""
        copy = self.copies[(stage, pipeline)]
        if self.group_sizes[stage] < 2 or not copy.trained:
            return
        if not self.cuda:
            self._start_allreduce(copy)
            handle = self.reducing[-1][3]
            if not isinstance(handle, StepSum):  # an exchange runs at `step`, in stage order
                self._issue(f"reduce{stage}", handle)
            return
        with torch.cuda.stream(self._stream(f"reduce{stage}")):
            self._start_allreduce(copy)
            self.reducing[-1][3].wait()

    # ---- compute: slots in, slots out --------------------------------------------------------

    def slot_forward(
        self,
        mb: int,
        stage: int,
        pipeline: str,
        x: str | None = None,
        y: str | None = None,
        chunk: int | None = None,
    ) -> None:
        if x is not None:
            key = self.input_key(mb, stage, pipeline, chunk)
            self.values[key] = self._view(x, stage - 1, key[4], mb).clone()
        self.forward(mb=mb, stage=stage, pipeline=pipeline, chunk=chunk)
        if y is not None:
            self._view(y, stage, chunk, mb).copy_(
                self.values.pop(("F", mb, stage, pipeline, chunk))
            )

    def slot_frozen_forward(self, mb: int, stage: int, pipeline: str, y: str | None = None) -> None:
        self.frozen_forward(mb=mb, stage=stage, pipeline=pipeline)
        if y is not None:
            self._view(y, -1, None, mb).copy_(self.values.pop(("P", mb, stage, pipeline, None)))

    def slot_backward(
        self,
        mb: int,
        stage: int,
        pipeline: str,
        dy: str | None = None,
        dx: str | None = None,
        chunk: int | None = None,
    ) -> None:
        if dy is not None:
            incoming = self._view(dy, stage, chunk, mb)
            # a split backward keeps dy until W, when the slot may hold another value
            split = self.split_backward and (mb, stage, pipeline, chunk) not in self.settings.whole
            self.values[("B", mb, stage + 1, pipeline, chunk)] = (
                incoming.clone() if split else incoming
            )
        self.backward(mb=mb, stage=stage, pipeline=pipeline, chunk=chunk)
        if dx is not None:
            self._view(dx, stage - 1, chunk, mb).copy_(
                self.values.pop(("B", mb, stage, pipeline, chunk))
            )

    def end_step(self) -> dict[int, float]:
        self.issued.clear()
        self.marks.clear()
        self.waited.clear()
        return super().end_step()


def _peer(stream: str) -> int | None:
    """The rank a channel stream talks to (`send3`, `recv3`); None for another stream."""
    for prefix in ("send", "recv"):
        if stream.startswith(prefix) and stream[len(prefix) :].isdigit():
            return int(stream[len(prefix) :])
    return None


def _nbytes(shape_dtype: tuple[tuple[int, ...], torch.dtype]) -> int:
    shape, dtype = shape_dtype
    return math.prod(shape) * dtype.itemsize
