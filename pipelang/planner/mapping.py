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
runs on the fastest ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

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


def map_ranks(
    traffic: Traffic, num_ranks: int, topology: Topology, sweeps: int = 20
) -> tuple[int, ...]:
    """Device of every rank (distinct devices), a local minimum of `mapping_cost`."""
    if num_ranks > topology.size:
        raise ValueError(f"{num_ranks} ranks on {topology.size} devices")
    neighbours: dict[int, list[tuple[int, float, int]]] = defaultdict(list)
    for (a, b), (size, messages) in traffic.items():
        neighbours[a].append((b, size, messages))
        neighbours[b].append((a, size, messages))
    fastest = sorted(range(topology.size), key=lambda d: -topology.speed_of(d))
    devices, free = fastest[:num_ranks], fastest[num_ranks:]
    speed = topology.speed_of

    def cost_of(rank: int, device: int, skip: int = -1) -> float:
        total = 0.0
        for other, size, messages in neighbours[rank]:
            if other == skip:
                continue
            there = devices[other]
            if there != device:
                link = topology.link(device, there)
                total += size / link.bandwidth + messages * link.latency
        return total

    for _ in range(sweeps):
        improved = False
        for a in range(num_ranks):
            for b in range(a + 1, num_ranks):
                p, q = devices[a], devices[b]
                before = cost_of(a, p, b) + cost_of(b, q, a)
                after = cost_of(a, q, b) + cost_of(b, p, a)
                if after < before - 1e-15:
                    devices[a], devices[b] = q, p
                    improved = True
            for index, device in enumerate(free):
                if speed(device) < speed(devices[a]):
                    continue
                if cost_of(a, device) < cost_of(a, devices[a]) - 1e-15:
                    free[index], devices[a] = devices[a], device
                    improved = True
        if not improved:
            break
    return tuple(devices)
