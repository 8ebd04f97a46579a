"""How ranks move tensors: point-to-point channels and replica allreduce.

`DistTransport` runs over torch.distributed (gloo on CPU, nccl on GPUs): one process group
per directed rank pair that talks, so a receive can never queue behind unrelated traffic,
and one group per stage whose replicas live on several ranks. Sends are non-blocking and
waited at the end of the step; receives block; allreduces start at `allreduce` and are
waited at `step`. Every sum over processes adds in `summation.tree_sum`'s order.

With `--dp K` the run has K copies of the pipeline, K x R processes, replica-major: the
process of rank r in copy k is `k * R + r`; with `--tp T` each rank is T processes, rank r
of copy k on tensor rank t being `k * R * T + r * T + t` (backends/mesh.py numbers them).
A transport speaks program ranks (0..R-1) and maps them into its own copy and tensor rank;
channels stay inside a copy and a tensor rank (tensor rank t of a stage sends to tensor
rank t of the next: the activations are whole on each), and a stage's reduce group holds
its replicas in every copy (K x the schedule's replicas), on one tensor rank.

`LocalHub` runs every rank of a program in one process, each rank a thread; only one
thread runs at a time and the baton passes, in rank order, when a rank must wait for a
message. On CUDA each rank computes on a stream of its own and a message is a device copy
ordered by events.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from pipelang.backends.mesh import Grid, device_mesh
from pipelang.backends.summation import exchange_sum, tree_sum
from pipelang.ir import COMM_KINDS, Program
from pipelang.ir.placement import reduce_ranks


class PeerFailure(Exception):
    """Communication failed because another rank stopped (a consequence, not the cause)."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        """The program rank (in this rank's data-parallel copy) it was talking to, when
        one: a transfer's; None for a collective."""

    def who(self, base: int = 0) -> str:
        """Who went away: `rank K` (K = `base` + the peer) when known, else the address
        the transport names (`the peer at 10.0.0.2:36021`), else `a peer`."""
        if self.peer is not None:
            return f"rank {base + self.peer}"
        found = re.search(r"\[([0-9A-Za-z.:-]+)\]:(\d+)", str(self))
        return f"the peer at {found[1]}:{found[2]}" if found else "a peer"


@contextlib.contextmanager
def peer_failures(peer: int | None = None) -> Iterator[None]:
    """Around calls into torch.distributed: their RuntimeError (a peer that stopped, a
    closed connection) becomes PeerFailure, so that the report names the rank that
    failed first and not the ones it left waiting; `peer` is the rank talked to."""
    try:
        yield
    except RuntimeError as err:
        raise PeerFailure(str(err), peer) from err


RELEASE_LIMIT = 1.0
"""Seconds `let_go` waits at most for a worker thread to let go of a tensor."""


def uses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """How many references each tensor's C++ TensorImpl has now (`let_go`)."""
    return [_references(t) for t in tensors]


def _references(tensor: torch.Tensor) -> int:
    return int(tensor._use_count())  # type: ignore[attr-defined]


def let_go(tensors: Sequence[torch.Tensor], counts: Sequence[int]) -> None:
    """Wait (at most RELEASE_LIMIT) until no thread but this one holds `tensors`: each
    back to the references `uses` counted before a collective on it started.

    A gloo collective's wait returns when the work is done, but the process group's
    worker thread lets go of the work, and of its tensors, a moment later. Had the
    Python tensor died first, that thread must take the GIL to free it; once the
    interpreter is finalizing (the script ended), Python ends the thread inside the
    work's destructor and the process aborts ("terminate called without an active
    exception"). Waiting here keeps every tensor pipelang hands to a collective alive
    in Python until torch's threads are done with it. (CPU tensors; nccl's are
    released by its watchdog thread, not waited for.)"""
    deadline = time.monotonic() + RELEASE_LIMIT
    pairs = [(t, n) for t, n in zip(tensors, counts, strict=True) if t.device.type == "cpu"]
    while any(_references(t) > n for t, n in pairs) and time.monotonic() < deadline:
        time.sleep(0.0001)


@contextlib.contextmanager
def settled(*tensors: torch.Tensor) -> Iterator[None]:
    """Around a blocking collective on `tensors`: on leaving, `let_go` of them."""
    counts = uses(tensors)
    yield
    let_go(tensors, counts)


class Handle(Protocol):
    """Something started that must finish before its result is used."""

    def wait(self) -> object: ...


class Transport(Protocol):
    """What a rank's runtime needs from the communication layer."""

    def send(self, tensor: torch.Tensor, peer: int) -> None: ...

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> torch.Tensor: ...

    def allreduce(self, stage: int, flat: torch.Tensor) -> Handle: ...

    def world_sum(self, value: torch.Tensor) -> torch.Tensor: ...

    def end_step(self) -> None: ...


def channels(program: Program) -> list[tuple[int, int]]:
    """Every directed (sender, receiver) pair the program moves data or signals over."""
    pairs = set()
    for rank, actions in enumerate(program.ranks):
        for a in actions:
            if a.kind in COMM_KINDS and a.peer is not None:
                sending = a.kind.value in ("send", "signal")
                pairs.add((rank, a.peer) if sending else (a.peer, rank))
    return sorted(pairs)


class DistTransport:
    """torch.distributed channels; every rank must construct it (groups are collective).

    `rank` is the program rank; `replica` the data-parallel copy (of `dp`) it belongs to,
    `tensor` its tensor rank (of `tp`); with `tp` > 1 it builds the run's DeviceMesh
    (`mesh`, backends/mesh.py), whose "tp" dimension a rank's stages are split over.
    """

    def __init__(
        self,
        program: Program,
        rank: int,
        device: torch.device,
        timeout: float,
        replica: int = 0,
        dp: int = 1,
        tp: int = 1,
        tensor: int = 0,
    ) -> None:
        self.rank = rank
        self.tensor = tensor
        self.device = device
        self.cuda = device.type == "cuda"
        wait = timedelta(seconds=timeout)
        grid = Grid(dp, program.num_ranks, tp)
        me = grid.process(replica, rank, tensor)
        # peer -> (group, the peer's rank in it): sends and receives call the group
        # directly, skipping torch.distributed's per-call argument checks and lookups.
        self.out: dict[int, tuple[dist.ProcessGroup, int]] = {}
        self.into: dict[int, tuple[dist.ProcessGroup, int]] = {}
        self.streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        # every process creates every group, in the same order
        for k, t in ((k, t) for k in range(dp) for t in range(tp)):
            for src, dst in channels(program):
                ends = [grid.process(k, src, t), grid.process(k, dst, t)]
                group = dist.new_group(ends, timeout=wait)
                if (k, t) != (replica, tensor) or rank not in (src, dst):
                    continue
                peer = dst if src == rank else src
                table = self.out if src == rank else self.into
                table[peer] = (group, dist.get_group_rank(group, grid.process(k, peer, t)))
                if self.cuda:
                    self.streams[(src, dst)] = torch.cuda.Stream(device)
        self.reduce_groups: dict[int, tuple[dist.ProcessGroup, list[int]]] = {}
        for stage, t in ((s, t) for s in range(program.num_stages) for t in range(tp)):
            copies = (divmod(p, program.num_ranks) for p in reduce_ranks(program, stage, dp))
            ranks = [grid.process(k, r, t) for k, r in copies]
            if len(ranks) > 1:
                group = dist.new_group(ranks, timeout=wait)
                if me in ranks:
                    self.reduce_groups[stage] = (group, ranks)
        self.mesh = device_mesh(grid, device.type) if tp > 1 else None
        """The run's DeviceMesh ("dp", "pp", "tp"), with `--tp`; None without."""
        self.me = me
        self.world = grid.world
        self.sends: list[tuple[dist.Work, torch.Tensor, int]] = []

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        group, group_peer = self.out[peer]
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        if self.cuda:
            stream = self.streams[(self.rank, peer)]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            tensor.record_stream(stream)
            with torch.cuda.stream(stream):
                work = group.send([tensor], group_peer, 0)
        else:
            work = group.send([tensor], group_peer, 0)
        self.sends.append((work, tensor, peer))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> torch.Tensor:
        group, group_peer = self.into[peer]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        if not self.cuda:
            group.recv([buf], group_peer, 0).wait()
            return buf
        stream = self.streams[(peer, self.rank)]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            group.recv([buf], group_peer, 0).wait()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        buf.record_stream(torch.cuda.current_stream(self.device))
        return buf

    def allreduce(self, stage: int, flat: torch.Tensor) -> Handle:
        """Start summing `flat` over the stage's copies, in `summation.tree_sum`'s order:
        an allreduce for two (one addition, exact either way), exchanges for more (run
        when the handle is waited)."""
        group, members = self.reduce_groups[stage]
        if len(members) > 2:
            return StepSum(flat, members, members.index(self.me), group)
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None
        return work

    def world_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over every process of the run (`--clip-grad`'s norm, tied
        weights), in `summation.tree_sum`'s order."""
        if self.world > 2:
            exchange_sum(value, range(self.world), self.me, None)
        else:  # no `settled`: a rank ends by os._exit (multiprocessing, or the CLI's
            # `leave` under torchrun), never in the finalization where that race lives
            dist.all_reduce(value)
        return value

    def end_step(self) -> None:
        for work, _, peer in self.sends:
            with peer_failures(peer):
                work.wait()
        self.sends.clear()


class StepSum:
    """A sum over more than two copies by `summation.exchange_sum`, run at `wait`: every
    member waits for it at `step`, where they take their stages in one order (a CPU
    rank blocks in an exchange, and two ranks waiting in different orders would
    deadlock)."""

    def __init__(self, flat: torch.Tensor, members: list[int], me: int, group: object) -> None:
        self.args: tuple[torch.Tensor, list[int], int, object] | None = (flat, members, me, group)

    def wait(self) -> None:
        if self.args is not None:
            exchange_sum(*self.args)
            self.args = None


class Aborted(Exception):
    """Another rank of a local run failed; this one stops."""


class LocalHub:
    """All ranks of a program in one process; see the module docstring."""

    def __init__(self, program: Program, device: torch.device, dp: int = 1) -> None:
        self.program = program
        self.device = device
        self.dp = dp
        self.world = program.num_ranks * dp
        self._cond = threading.Condition()
        self._running = 0
        self._waiting: dict[int, Callable[[], bool]] = {}
        self._finished: set[int] = set()
        self.failure: BaseException | None = None
        base = [k * program.num_ranks for k in range(dp)]
        self.mailbox: dict[tuple[int, int], deque[tuple[torch.Tensor, object]]] = {
            (b + src, b + dst): deque() for b in base for src, dst in channels(program)
        }
        self._reductions: dict[tuple[int, int], _Reduction] = {}

    @property
    def holder(self) -> int:
        """The rank that holds the baton (the only one running)."""
        return self._running

    def start(self, rank: int) -> None:
        """Block until `rank` holds the baton for the first time."""
        with self._cond:
            self._cond.wait_for(lambda: self.failure is not None or self._running == rank)
            self._check()

    def block_until(self, rank: int, ready: Callable[[], bool]) -> None:
        """Pass the baton on until `ready()` holds, then take it back."""
        with self._cond:
            while not ready():
                self._waiting[rank] = ready
                self._pass_baton(rank)
                self._cond.wait_for(lambda: self.failure is not None or self._running == rank)
                self._check()
            self._waiting.pop(rank, None)

    def finish(self, rank: int, error: BaseException | None = None) -> None:
        """`rank` is done (or failed with `error`): hand the baton on for good."""
        with self._cond:
            self._finished.add(rank)
            if error is not None and self.failure is None:
                self.failure = error
            if self.failure is None:
                self._pass_baton(rank)
            self._cond.notify_all()

    def abort(self, error: BaseException) -> None:
        """Stop every rank (a timeout seen by the caller, say)."""
        with self._cond:
            self.failure = self.failure or error
            self._cond.notify_all()

    def _check(self) -> None:
        if self.failure is not None:
            raise Aborted from None

    def _pass_baton(self, rank: int) -> None:
        for k in range(1, self.world + 1):
            other = (rank + k) % self.world
            ready = self._waiting.get(other)
            if other not in self._finished and (ready is None or ready()):
                self._running = other
                self._cond.notify_all()
                return
        if len(self._finished) < self.world:
            waiting = sorted(self._waiting)
            self.failure = RuntimeError(f"local run deadlocked: ranks {waiting} all wait")
        self._cond.notify_all()

    def reduction(self, step: int, stage: int) -> _Reduction:
        """Step `step`'s allreduce of `stage`'s replicas; a negative stage: the k-th
        sum over every rank (`world_sum`)."""
        key = (step, stage)
        if key not in self._reductions:
            members = self.world
            if stage >= 0:
                members = len(reduce_ranks(self.program, stage, self.dp))
            self._reductions[key] = _Reduction(members)
        return self._reductions[key]


class _Reduction:
    """One stage's allreduce in a local run: the last contributor sums, in rank order."""

    def __init__(self, members: int) -> None:
        self.members = members
        self.parts: dict[int, tuple[torch.Tensor, object]] = {}
        self.done = False
        self.event: object = None


class LocalTransport:
    """One rank's view of a `LocalHub`: `rank` is the thread's rank in the whole run
    (`replica * R + program rank`); peers are program ranks of the same copy."""

    def __init__(self, hub: LocalHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.base = rank - rank % hub.program.num_ranks
        self.cuda = hub.device.type == "cuda"
        self.stream = torch.cuda.Stream(hub.device) if self.cuda else None
        self.step_index = 0
        self.world_sums = 0

    def _event(self) -> object:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _wait_event(self, event: object) -> None:
        if self.cuda and self.stream is not None:
            self.stream.wait_event(event)  # type: ignore[arg-type]

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.hub.mailbox[(self.rank, self.base + peer)].append((tensor, self._event()))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> torch.Tensor:
        peer += self.base
        box = self.hub.mailbox[(peer, self.rank)]
        self.hub.block_until(self.rank, lambda: bool(box))
        tensor, event = box.popleft()
        self._wait_event(event)
        if self.stream is not None:
            # The sender may free its tensor now; keep the memory until our copy has run.
            tensor.record_stream(self.stream)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(
                f"rank {peer} sent {tuple(tensor.shape)} {tensor.dtype}, "
                f"rank {self.rank} expected {shape} {dtype}"
            )
        return tensor.clone()  # the device copy: the sender keeps its own tensor

    def world_sum(self, value: torch.Tensor) -> torch.Tensor:
        self.world_sums += 1  # each call of a step is a reduction of its own
        self.allreduce(-self.world_sums, value).wait()
        return value

    def allreduce(self, stage: int, flat: torch.Tensor) -> Handle:
        reduction = self.hub.reduction(self.step_index, stage)
        reduction.parts[self.rank] = (flat, self._event())
        if len(reduction.parts) == reduction.members:
            parts = [reduction.parts[r] for r in sorted(reduction.parts)]
            for _, event in parts:
                self._wait_event(event)
            total = tree_sum([part for part, _ in parts])
            for part, _ in parts:
                part.copy_(total)
            reduction.event = self._event()
            reduction.done = True
        return _LocalWork(self, reduction)

    def end_step(self) -> None:
        self.step_index += 1
        self.world_sums = 0


class _LocalWork:
    def __init__(self, transport: LocalTransport, reduction: _Reduction) -> None:
        self.transport = transport
        self.reduction = reduction

    def wait(self) -> None:
        self.transport.hub.block_until(self.transport.rank, lambda: self.reduction.done)
        self.transport._wait_event(self.reduction.event)
