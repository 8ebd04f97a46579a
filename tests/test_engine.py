"""The one timing engine (`pipelang.sim.engine`): its two rules against an independent
longest-path oracle and against each other, and the orders built on it (`order greedy`,
`squeeze`) timed exactly as `simulate` times the result."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from pathlib import Path

import networkx as nx
import pytest

from pipelang import api
from pipelang.orders import greedy
from pipelang.sim.engine import Engine, Input


def random_schedule(seed: int) -> tuple[list[int], list[float], list[list[Input]], list[list[int]]]:
    """A random DAG of ops on 3 ranks: each rank's order, and inputs only from ops
    earlier in a global order (so every order can run)."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    ranks = [rng.randrange(3) for _ in range(n)]
    times = [rng.choice([0.0, 0.5, 1.0, 2.0, 3.0]) for _ in range(n)]
    inputs: list[list[Input]] = [
        [(u, rng.random() < 0.7) for u in rng.sample(range(v), min(v, rng.randint(0, 3)))]
        for v in range(n)
    ]
    orders: list[list[int]] = [[] for _ in range(3)]
    for v, rank in enumerate(ranks):
        orders[rank].append(v)
    return ranks, times, inputs, orders


def longest_paths(
    ranks: list[int],
    times: list[float],
    inputs: list[list[Input]],
    orders: list[list[int]],
    c: float,
) -> dict[int, float]:
    """Earliest starts as longest paths in a networkx DAG: an op starts once every op
    before it on its rank and each input (plus `c` across ranks, for a result) ended."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(times)))
    for order in orders:
        for u, v in itertools.pairwise(order):
            graph.add_edge(u, v, delay=0.0)
    for v, ins in enumerate(inputs):
        for u, delayed in ins:
            delay = c if delayed and ranks[u] != ranks[v] else 0.0
            if graph.has_edge(u, v):
                delay = max(delay, graph.edges[u, v]["delay"])
            graph.add_edge(u, v, delay=delay)
    start = dict.fromkeys(graph, 0.0)
    for v in nx.topological_sort(graph):
        for u in graph.predecessors(v):
            start[v] = max(start[v], start[u] + times[u] + graph.edges[u, v]["delay"])
    return start


@pytest.mark.parametrize("seed", range(60))
def test_fixed_orders_start_at_their_longest_path(seed: int) -> None:
    ranks, times, inputs, orders = random_schedule(seed)
    start, timed = Engine(ranks, times, inputs, transfer=1.5).fixed(orders)
    assert sorted(timed) == list(range(len(times)))
    assert start == pytest.approx(
        [longest_paths(ranks, times, inputs, orders, 1.5)[v] for v in range(len(times))]
    )


class Follow:
    """A policy that runs each rank's ops in a given order: list scheduling with no
    choice, which must time them as `fixed` does."""

    def __init__(self, orders: list[list[int]], rank_of: list[int]) -> None:
        self.next = [0] * len(orders)
        self.orders = orders
        self.rank_of = rank_of
        self.ready: set[int] = set()
        self.at: dict[int, float] = {}

    def queue(self, op: int, at: float) -> int:
        self.ready.add(op)
        self.at[op] = at
        return self.rank_of[op]

    def pick(self, rank: int, time: float) -> int | None:
        order = self.orders[rank]
        if self.next[rank] < len(order):
            op = order[self.next[rank]]
            if op in self.ready and self.at[op] <= time:
                self.next[rank] += 1
                return op
        return None

    def ended(self, op: int, time: float) -> Iterable[int]:
        return ()


@pytest.mark.parametrize("seed", range(30))
def test_dispatch_with_no_choice_times_as_fixed_does(seed: int) -> None:
    ranks, times, inputs, orders = random_schedule(seed)
    start, _ = Engine(ranks, times, inputs, transfer=0.5).fixed(orders)
    ran, end, pending = Engine(ranks, times, inputs, transfer=0.5).dispatch(
        Follow(orders, ranks), 3
    )
    assert ran == orders
    assert not any(pending)
    assert end == pytest.approx(
        max((s + t for s, t in zip(start, times, strict=True)), default=0.0)
    )


def test_a_cycle_times_fewer_ops() -> None:
    _, timed = Engine([0, 1], [1.0, 1.0], [[(1, True)], [(0, True)]]).fixed([[0], [1]])
    assert timed == []


GREEDY = """\
schedule shaped_chunks(D: int = 4, N: int = 6, C: int = 2) {
    ops F, B, W
    cost F = 1, B = 2, W = 1, A = 0.4, C = 0.25, F[3] = 3
    pipeline main: stage s in 0..D -> rank s
    microbatches 0..N -> main
    chunks C
    lengths 100, 400, 200, 800, 300, 150
    order greedy { prefer B, F, W  priority mb, chunk  cap C + D - 1 - rank }
}
"""


def test_a_greedy_order_ends_when_simulate_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With sequence chunks, micro-batches of different lengths, W split off, a slow
    last stage and transfers, the greedy rule's own replay ends exactly when `simulate`
    says the order it built ends: both time ops on the one engine."""
    ends: list[float] = []
    original = greedy._Replay.run

    def recording(self: greedy._Replay, upfront: bool) -> object:
        orders, end = original(self, upfront)
        ends.append(end)
        return orders, end

    monkeypatch.setattr(greedy._Replay, "run", recording)
    path = tmp_path / "shaped_chunks.pipe"
    path.write_text(GREEDY)
    compiled = api.compile_schedule(str(path), {})
    program = compiled.need_program()
    assert program.chunks is not None and program.shapes is not None
    assert ends == [pytest.approx(compiled.timeline().makespan)]
    assert len({e.end for e in compiled.timeline().events}) > 10  # the times really differ
