"""The one timing engine: when each op runs, given how long it takes and what it waits for.

Ops are numbered `0..n-1`. Each has a rank, a duration and its inputs: the ops that must
end before it starts, each either a result it reads (`delayed`: from another rank it
arrives one transfer later) or an ordering alone (an `after` dependency: it costs
nothing). Everything that times ops asks here:

- `durations`: how long each op runs, a compound as one (the overlapped pair's `FB` cost,
  else the sum of its ops; its fused ops take no time), each op as the cost model's
  `timer` says (each chunk its share, each shaped micro-batch its factor);
- `Engine.fixed`: every rank runs its ops in a given order, each as soon as the op
  before it on its rank and its inputs have ended (`simulate`, and `squeeze` for the
  plain order it starts from);
- `Engine.dispatch`: whenever a rank is idle, a `Policy` picks which of its ready ops it
  runs (`order greedy`).

A transfer takes `transfer` (the cost model's `C`), or `link(op, src, dst)` when one is
given (the planner's links between devices, an eviction's hop to its partner).

    ranks  0 0 1 1       fixed([[0, 1], [2, 3]]), transfer 0, durations 1 2 1 2
    inputs 0: -  1: 0,3  2: 0  3: 2
  =>
    starts 0 4 1 2
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from pipelang.ir import Action, CostModel, Kind

Link = Callable[[Action, int, int], float]
"""The time to move an op's result from one rank to another: `link(op, src, dst)`."""

Input = tuple[int, bool]
"""One op another waits for: (its number, whether its result travels: `delayed`)."""


def durations(
    ops: Sequence[Action], heads: Sequence[int], time: Callable[[Action], float], costs: CostModel
) -> list[float]:
    """How long each op runs: `time(op)` (`CostModel.timer`), except that a compound's
    whole time goes to its first op (`heads[i]` is the first op of op i's compound, i
    itself when it is not fused) and its fused ops take none, so that whatever follows
    any of them waits for the whole compound. A compound of a forward and a backward takes
    the `FB` cost where the model gives one (the forward's stage picks it)."""
    times = [time(op) for op in ops]
    members: dict[int, list[int]] = {}
    for node, head in enumerate(heads):
        if head != node:
            members.setdefault(head, [head]).append(node)
    overlap = costs.gives("FB")
    for head, group in members.items():
        actions = [ops[node] for node in group]
        forwards = [a for a in actions if a.kind is Kind.F]
        if overlap and forwards and any(a.kind is Kind.B for a in actions):
            times[head] = costs.of("FB", forwards[0].stage)
        else:
            times[head] = sum(times[node] for node in group)
        for node in group[1:]:
            times[node] = 0.0
    return times


class Policy(Protocol):
    """What `Engine.dispatch` asks of a list-scheduling rule."""

    def queue(self, op: int, at: float) -> int | None:
        """`op`'s inputs have all arrived, the last at `at`: keep it, and name the rank
        to wake then (None: none; the op waits for a rank that asks)."""

    def pick(self, rank: int, time: float) -> int | None:
        """The op idle `rank` runs at `time`, among those queued; None to stay idle."""

    def ended(self, op: int, time: float) -> Iterable[int]:
        """`op` ended at `time`: the ops gated on it that may go (see `dispatch`)."""


_IDLE = -1
"""A dispatch event that only wakes a rank (no op ended)."""


class Engine:
    """Ops, their ranks (-1: a rank picks it when it runs it, as a frozen forward any
    holder may take), durations and inputs, timed by either of the two rules."""

    def __init__(
        self,
        ranks: Sequence[int],
        times: Sequence[float],
        inputs: Sequence[Sequence[Input]],
        transfer: float = 0.0,
        link: Link | None = None,
        actions: Sequence[Action] = (),
    ) -> None:
        self.ranks = list(ranks)
        self.times = times
        self.inputs = inputs
        self.transfer = transfer
        self.link = link
        self.actions = actions
        """The ops' Actions, for `link`."""

    def delay(self, u: int, v: int) -> float:
        """How long after `u` ends its result reaches `v`: nothing on one rank, else the
        transfer (`link`'s for this op and these ranks, when given)."""
        src, dst = self.ranks[u], self.ranks[v]
        if src == dst:
            return 0.0
        return self.transfer if self.link is None else self.link(self.actions[u], src, dst)

    def timed_inputs(self) -> list[list[tuple[int, float]]]:
        """Every op's inputs, each with the delay from its end to the op's earliest start
        (`delay`; computed here in one sweep, as this runs once per dependency)."""
        ranks, transfer = self.ranks, self.transfer
        if self.link is None:
            return [
                [(u, transfer if delayed and ranks[u] != rank else 0.0) for u, delayed in ins]
                for ins, rank in zip(self.inputs, ranks, strict=True)
            ]
        delay = self.delay
        return [
            [(u, delay(u, v) if delayed else 0.0) for u, delayed in ins]
            for v, ins in enumerate(self.inputs)
        ]

    def fixed(self, orders: Sequence[Sequence[int]]) -> tuple[list[float], list[int]]:
        """Each rank runs `orders[r]` in that order: every op starts when the op before it
        on its rank and its inputs have ended (plus their delays). Returns every op's
        start and the ops in the order they were timed, a topological order; fewer ops
        when some wait on each other in a cycle (or are in no order).

        The ranks are walked in turn, each as far as its next op is ready; a rank whose
        op waits is looked at again once an input of it ends, in the ops' numbering
        order, which breaks ties between ops that start together."""
        times, n = self.times, len(self.times)
        inputs = self.timed_inputs()
        waiting: list[list[int]] = [[] for _ in range(n)]
        for ins, rank in zip(inputs, self.ranks, strict=True):
            for u, _ in ins:
                waiting[u].append(rank)
        start = [0.0] * n
        end = [0.0] * n
        done = [False] * n
        timed: list[int] = []
        position = [0] * len(orders)
        free_at = [0.0] * len(orders)
        todo = deque(range(len(orders)))
        while todo:
            r = todo.popleft()
            order, at, begin = orders[r], position[r], free_at[r]
            while at < len(order):
                v = order[at]
                s = begin
                for u, d in inputs[v]:
                    if not done[u]:
                        break
                    if end[u] + d > s:  # not max(): once per input, 10^6 of them
                        s = end[u] + d
                else:
                    start[v], begin = s, s + times[v]
                    end[v], done[v] = begin, True
                    timed.append(v)
                    at += 1
                    todo.extend(waiting[v])
                    continue
                break
            position[r], free_at[r] = at, begin
        return start, timed

    def dispatch(
        self, policy: Policy, num_ranks: int, gated: Sequence[int] = ()
    ) -> tuple[list[list[int]], float, list[int]]:
        """List scheduling: whenever a rank is idle it runs the op `policy.pick` gives,
        among those `policy.queue` kept once their inputs arrived. An op of rank -1 takes
        the rank that runs it. Each op of `gated` also waits for one op that
        `policy.ended` names. Returns each rank's ops in the order it ran them, when the
        last ended, and per op how many inputs it still waits for (all 0 unless the rule
        got stuck).

        Events at one time go: ops ending (their consumers queued), then idle ranks by
        index; ops that become ready together queue in the order their inputs arrived."""
        times, ranks = self.times, self.ranks
        pending = [len(ins) for ins in self.inputs]
        for v in gated:
            pending[v] += 1
        consumers: list[list[tuple[int, bool]]] = [[] for _ in times]
        for v, ins in enumerate(self.inputs):
            for u, delayed in ins:
                consumers[u].append((v, delayed))
        ready_at = [0.0] * len(times)
        events: list[tuple[float, int, int, int]] = [(0.0, 1, r, _IDLE) for r in range(num_ranks)]

        def release(v: int, at: float) -> None:
            if at > ready_at[v]:
                ready_at[v] = at
            pending[v] -= 1
            if pending[v] == 0:
                rank = policy.queue(v, ready_at[v])
                if rank is not None:
                    heapq.heappush(events, (ready_at[v], 1, rank, _IDLE))

        for v, count in enumerate(pending):
            if count == 0:
                policy.queue(v, 0.0)  # every rank wakes at 0 anyway
        orders: list[list[int]] = [[] for _ in range(num_ranks)]
        free_at = [0.0] * num_ranks
        end = 0.0
        while events:
            time, _, rank, ended = heapq.heappop(events)
            if ended != _IDLE:
                for v, delayed in consumers[ended]:
                    release(v, time + self.delay(ended, v) if delayed else time)
                for v in policy.ended(ended, time):
                    release(v, time)
                continue
            if free_at[rank] > time:
                continue
            chosen = policy.pick(rank, time)
            if chosen is None:
                continue
            ranks[chosen] = rank
            free_at[rank] = time + times[chosen]
            end = max(end, free_at[rank])
            orders[rank].append(chosen)
            heapq.heappush(events, (free_at[rank], 0, rank, chosen))
            heapq.heappush(events, (free_at[rank], 1, rank, _IDLE))
        return orders, end, pending
