"""Put a schedule's ranks on a cluster's devices so that heavy traffic takes fast links.

The traffic between two ranks is what the compiled program sends between them in one
iteration: activations forward and gradients back at every stage boundary the two
ranks share, and the gradient allreduce of the stages they both replicate. Placing rank
a on device p and rank b on device q costs bytes(a, b) / bandwidth(p, q) plus
messages(a, b) * latency(p, q); the mapping minimises the sum over all pairs (a
quadratic assignment problem). It starts from rank r on the r-th fastest device (rank r
on device r when all are equally fast) and improves by swapping two ranks' devices, or
moving a rank to an unused device as fast as its own, while any such step lowers the
cost: a local optimum, found in a few sweeps. So a plan with fewer ranks than devices
runs on the fastest ones. On devices of different speed the search also asks for the
mapping that weighs links only (`links_first`: the ranks placed greedily from several
seats, heaviest traffic first, each onto the free device with the cheapest links to
those placed, then improved as above with any device free to take a rank), and keeps
the one the simulator finds faster: a slower device beside a fast one can beat a fast
device across a slow link.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from pipelang.planner import budget
from pipelang.planner.topology import Topology

Traffic = Mapping[tuple[int, int], tuple[float, int]]
"""(rank a, rank b) with a < b -> (bytes, messages) between them per iteration."""


def mapping_cost(traffic: Traffic, devices: Sequence[int], topology: Topology) -> float:
    """Seconds the traffic spends on links when rank r runs on `devices[r]`."""
    total = 0.0
    for (a, b), (size, messages) in traffic.items():
        p, q = devices[a], devices[b]
        if p != q:
            link = topology.link(p, q)
            total += size / link.bandwidth + messages * link.latency
    return total


SEATS = 16
"""The most seats a links-first mapping starts from (one per kind of device)."""

Neighbours = Mapping[int, list[tuple[int, float, int]]]
"""rank -> (other rank, bytes, messages) of the traffic between them."""


def map_ranks(
    traffic: Traffic,
    num_ranks: int,
    topology: Topology,
    sweeps: int = 20,
    links_first: bool = False,
) -> tuple[int, ...]:
    """Device of every rank (distinct devices), a local minimum of `mapping_cost`:
    from rank r on the r-th fastest device, a rank moving only to a free device as fast
    as its own; or with `links_first`, the best of the greedy starts (see the module
    docstring), speed only breaking ties."""
    if num_ranks > topology.size:
        raise ValueError(f"{num_ranks} ranks on {topology.size} devices")
    neighbours: dict[int, list[tuple[int, float, int]]] = defaultdict(list)
    for (a, b), (size, messages) in traffic.items():
        neighbours[a].append((b, size, messages))
        neighbours[b].append((a, size, messages))
    if not links_first:
        fastest = sorted(range(topology.size), key=lambda d: -topology.speed_of(d))
        return _improve(neighbours, fastest[:num_ranks], topology, sweeps, False)
    found = []
    for seat in _seats(topology):
        start = _greedy(neighbours, num_ranks, seat, topology)
        devices = _improve(neighbours, start, topology, sweeps, True)
        speed = sum(topology.speed_of(d) for d in devices)
        found.append((mapping_cost(traffic, devices, topology), -speed, devices))
    return min(found)[2]


def _seats(topology: Topology) -> list[int]:
    """One device of each kind (its speed and the links of its row), at most `SEATS`."""
    kinds: dict[tuple[object, ...], int] = {}
    for device in range(topology.size):
        row = sorted(
            (link.bandwidth, link.latency) for link in topology.links[device] if link is not None
        )
        kinds.setdefault((topology.speed_of(device), tuple(row)), device)
        if len(kinds) == SEATS:
            break
    return list(kinds.values())


def _link_cost(
    neighbours: Neighbours, devices: Sequence[int], rank: int, device: int, topology: Topology
) -> float:
    """Seconds `rank`'s traffic to the placed ranks (device >= 0) spends on links, with
    `rank` on `device`."""
    total = 0.0
    for other, size, messages in neighbours.get(rank, ()):
        there = devices[other]
        if there >= 0 and there != device:
            link = topology.link(device, there)
            total += size / link.bandwidth + messages * link.latency
    return total


def _greedy(neighbours: Neighbours, num_ranks: int, seat: int, topology: Topology) -> list[int]:
    """Rank 0 on `seat`; then, the rank with the most traffic to those placed first, each
    on the free device with the cheapest links to them (the faster on a tie)."""
    devices = [-1] * num_ranks
    devices[0] = seat
    free = sorted(set(range(topology.size)) - {seat})
    for _ in range(num_ranks - 1):
        weight = {
            rank: sum(size for other, size, _ in neighbours.get(rank, ()) if devices[other] >= 0)
            for rank in range(num_ranks)
            if devices[rank] < 0
        }
        rank = max(weight, key=weight.__getitem__)
        device = min(
            free,
            key=lambda d: (
                _link_cost(neighbours, devices, rank, d, topology),
                -topology.speed_of(d),
            ),
        )
        devices[rank] = device
        free.remove(device)
    return devices


def _improve(
    neighbours: Neighbours, devices: list[int], topology: Topology, sweeps: int, any_speed: bool
) -> tuple[int, ...]:
    """Swaps and moves to free devices while `mapping_cost` falls (see the module
    docstring); a move to a slower device only with `any_speed`."""
    num_ranks = len(devices)
    used = set(devices)
    free = [
        d
        for d in sorted(range(topology.size), key=lambda d: -topology.speed_of(d))
        if d not in used
    ]
    speed = topology.speed_of

    def cost_of(rank: int, device: int, skip: int = -1) -> float:
        if skip < 0:
            return _link_cost(neighbours, devices, rank, device, topology)
        held, devices[skip] = devices[skip], -1
        total = _link_cost(neighbours, devices, rank, device, topology)
        devices[skip] = held
        return total

    for _ in range(sweeps):
        improved = False
        for a in range(num_ranks):
            budget.check()
            for b in range(a + 1, num_ranks):
                p, q = devices[a], devices[b]
                before = cost_of(a, p, b) + cost_of(b, q, a)
                after = cost_of(a, q, b) + cost_of(b, p, a)
                if after < before - 1e-15:
                    devices[a], devices[b] = q, p
                    improved = True
            for index, device in enumerate(free):
                if speed(device) < speed(devices[a]) and not any_speed:
                    continue
                if cost_of(a, device) < cost_of(a, devices[a]) - 1e-15:
                    free[index], devices[a] = devices[a], device
                    improved = True
        if not improved:
            break
    return tuple(devices)


def mapping_moves(devices: tuple[int, ...], topology: Topology) -> Iterable[tuple[int, ...]]:
    """Mappings one step away: two ranks' devices swapped, or one rank on a free device
    (of the free devices alike in speed and in their links to the used ones, only the
    first)."""
    for a in range(len(devices)):
        for b in range(a + 1, len(devices)):
            swapped = list(devices)
            swapped[a], swapped[b] = devices[b], devices[a]
            yield tuple(swapped)
    used = set(devices)
    kinds: dict[tuple[object, ...], int] = {}
    for device in range(topology.size):
        if device not in used:
            links = tuple(topology.links[device][u] for u in devices)
            kinds.setdefault((topology.speed_of(device), links), device)
    for rank in range(len(devices)):
        for device in kinds.values():
            yield (*devices[:rank], device, *devices[rank + 1 :])


EXACT_MAPPINGS = 64
"""The most unlike mappings a candidate's screening tries one by one, each with its DP
cut and the cuts one layer from it (`unlike_mappings`)."""
ENUMERATED = 5040
"""The most rank-to-device mappings looked through for unlike ones (7 ranks on 7
devices, 4 on 8)."""


def unlike_mappings(topology: Topology, ranks: int) -> list[tuple[int, ...]] | None:
    """Every mapping of `ranks` ranks to devices when there are 2 to `EXACT_MAPPINGS`
    unlike ones (mappings that give every rank a device of the same speed and memory and
    every pair of ranks the same link are alike), else None. On a few devices the local
    search can stop where two moves at once would help (issue 29: it found the best in
    21 of 30 random 3-4 device clusters, 23% off at worst)."""
    if math.perm(topology.size, ranks) > ENUMERATED:
        return None
    alike: dict[tuple[object, ...], tuple[int, ...]] = {}
    for devices in itertools.permutations(range(topology.size), ranks):
        speeds = tuple(topology.speed_of(d) for d in devices)
        memory = tuple(topology.memory[d] for d in devices)
        links = tuple(topology.links[a][b] for a, b in itertools.combinations(devices, 2))
        alike.setdefault((speeds, memory, links), devices)
        if len(alike) > EXACT_MAPPINGS:
            return None
        budget.check()
    return list(alike.values()) if len(alike) > 1 else None
