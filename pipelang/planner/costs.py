"""The planner's cost model, apart from its search: what each stage's ops, each transfer
and each rank's optimizer step take (`OpCosts`), traffic between ranks, the gradient allreduce of
replicated stages, and each rank's peak memory. Sizes and times come from the profile,
summed over the layers of each stage."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from pipelang.ir import MW_SHARE, Action, CostModel, Kind, Program, placement
from pipelang.planner.mapping import Traffic
from pipelang.planner.topology import Topology
from pipelang.profile import Profile
from pipelang.sim import memory
from pipelang.sim.engine import Link
from pipelang.sim.timeline import Event


class OpCosts:
    """The planner's cost model: how long each stage's ops and each rank's optimizer
    step take under a partition of the layers, from the profile and its runtime
    calibration. The search (planner/search.py) asks it and the written plan quotes it;
    it knows nothing of the search."""

    def __init__(self, profile: Profile, optimizer: str) -> None:
        self.profile = profile
        self.optimizer = optimizer
        self.runtime = profile.runtime
        """What the runtime adds per action and message (`profile --calibrate`), if known."""
        self.scale = self.runtime.compute_scale if self.runtime is not None else 1.0
        """Compute time beside the other ranks, over the profile's time alone."""
        self.layer_time = [self.scale * (c.forward_ms + c.full_backward_ms) for c in profile.layers]
        """Forward and backward of each layer, ms: what the partition balances."""

    def stage_costs(
        self,
        counts: Sequence[int],
        split_w: bool,
        crossing: Sequence[bool] | None = None,
        speeds: Sequence[float] | None = None,
    ) -> list[tuple[float, float, float]]:
        """(F, B, W) milliseconds of every stage; without split W, B is the whole backward.
        `speeds`: each stage's device speed relative to the profiled one (default 1),
        which divides its layers' times (not the host's).

        With the profile's `runtime` calibration, the layers' times are scaled by its
        `compute_scale`, every op gets the host time of one action, and an op that sends
        (F before boundary s, B after it) or receives (F after, B before) across a
        boundary that `crossing` says joins two ranks (default: every boundary) gets that
        send's or receive's host time and its action."""
        result, start = [], 0
        layers = self.profile.layers
        last = len(counts) - 1
        cross = list(crossing) if crossing is not None else [True] * last
        host = self.runtime
        for stage, count in enumerate(counts):
            part = layers[start : start + count]
            start += count
            scale = self.scale / (speeds[stage] if speeds is not None else 1.0)
            f = scale * sum(c.forward_ms for c in part)
            if split_w:
                # As the runtime splits a stage's backward (backends/weight_split.py):
                # B runs every layer's backward up to its weight ops (and the cheap
                # ones, norms and lone biases), W each weight op's parameter gradient,
                # so a stage's B and W are its layers' (`pipelang profile` times them
                # so, one layer at a time).
                b = scale * sum(c.backward_input_ms for c in part)
                w = scale * sum(c.backward_weight_ms for c in part)
            else:
                b, w = scale * sum(c.full_backward_ms for c in part), 0.0
            if host is not None:
                send, recv = host.send_ms + host.action_ms, host.recv_ms + host.action_ms
                after = stage < last and cross[stage]  # this stage's output leaves the rank
                before = stage > 0 and cross[stage - 1]  # its input comes from another rank
                f += host.action_ms + (send if after else 0.0) + (recv if before else 0.0)
                b += host.action_ms + (send if before else 0.0) + (recv if after else 0.0)
                w += host.action_ms if split_w else 0.0
            result.append((f, b, w))
        return result

    def cost_model(
        self,
        counts: Sequence[int],
        split_w: bool,
        crossing: Sequence[bool] | None = None,
        speeds: Sequence[float] | None = None,
    ) -> CostModel:
        entries: list[tuple[str, int | None, float]] = [("C", None, 0.0)]
        for stage, (f, b, w) in enumerate(self.stage_costs(counts, split_w, crossing, speeds)):
            entries += [("F", stage, f), ("B", stage, b), ("W", stage, w), ("R", stage, f)]
        return CostModel().merged(CostModel(tuple(entries)))

    def step_ms(
        self, counts: Sequence[int], program: Program, speeds: Sequence[float] | None = None
    ) -> list[float]:
        """The optimizer step of every rank (ms): the profile's step time of the layers
        of every stage copy it holds, scaled as compute (and by the rank's device speed,
        `speeds`, default 1), plus one action."""
        per_stage = sums([c.step_ms(self.optimizer) for c in self.profile.layers], counts)
        action = self.runtime.action_ms if self.runtime is not None else 0.0
        return [
            self.scale
            / (speeds[rank] if speeds is not None else 1.0)
            * sum(per_stage[s] for s, _ in program.stage_copies(rank))
            + action
            for rank in range(program.num_ranks)
        ]

    def boundary_ms(self, topology: Topology, a: int, b: int, size: float) -> float:
        """A stage boundary between devices `a` and `b` as the partition's DP sees it (ms):
        `size` bytes over their link, plus the host's whole cost of one message (message,
        send, receive and the two actions; the DP sees no other host cost); 0 on one
        device."""
        if a == b:
            return 0.0
        host = self.runtime
        per_message = 0.0
        if host is not None:
            per_message = host.message_ms + host.send_ms + host.recv_ms + 2 * host.action_ms
        return topology.link(a, b).seconds(size) * 1e3 + per_message

    def links(
        self, topology: Topology, devices: Sequence[int], outputs: Sequence[float]
    ) -> tuple[Link, list[float]]:
        """The simulator's `link` for ranks on `devices`: an op's result (`outputs[s]`,
        bytes, leaving stage s) over the link between the two ranks' devices, plus the
        host's time per message (its send and receive are in the ops' costs); and the list
        the distinct transfer times are added to as the simulator asks for them."""
        cache: dict[tuple[Kind, int, int, int], float] = {}
        transfers: list[float] = []
        message = self.runtime.message_ms if self.runtime is not None else 0.0

        def link(op: Action, src: int, dst: int) -> float:
            key = (op.kind, op.stage or 0, src, dst)
            if key not in cache:
                boundary = op.stage if op.kind is Kind.F else (op.stage or 0) - 1
                size = outputs[boundary] if boundary is not None and boundary >= 0 else 0.0
                seconds = topology.link(devices[src], devices[dst]).seconds(size)
                cache[key] = seconds * 1e3 + message
                transfers.append(cache[key])
            return cache[key]

        return link, transfers

    def iteration_ms(
        self,
        counts: Sequence[int],
        program: Program,
        events: Iterable[Event],
        speeds: Sequence[float],
        synced: float,
    ) -> float:
        """When the iteration ends: each rank's optimizer step (`step_ms`) runs after its
        last op and after the gradient allreduces (which end at `synced`)."""
        ends = [0.0] * program.num_ranks
        for event in events:
            ends[event.rank] = max(ends[event.rank], event.end)
        steps = self.step_ms(counts, program, speeds)
        return max(max(e, synced) + t for e, t in zip(ends, steps, strict=True))


def sums(values: Sequence[float], counts: Sequence[int]) -> list[float]:
    """`values` (one per layer) summed over each stage's layers."""
    result, start = [], 0
    for count in counts:
        result.append(sum(values[start : start + count]))
        start += count
    return result


def stage_weights(profile: Profile, counts: Sequence[int]) -> list[float]:
    return sums([c.weight_bytes for c in profile.layers], counts)


def stage_activations(profile: Profile, counts: Sequence[int]) -> list[float]:
    return sums([c.activation_bytes for c in profile.layers], counts)


def stage_w_shares(profile: Profile, counts: Sequence[int]) -> list[float]:
    """Per stage, the share of its activations a split backward keeps after B for W
    (the profile's `w_activation_bytes`, else `ir.MW_SHARE` of a layer's activations)."""
    kept = [
        MW_SHARE * c.activation_bytes
        if c.w_activation_bytes is None
        else min(c.activation_bytes, c.w_activation_bytes)
        for c in profile.layers
    ]
    whole = stage_activations(profile, counts)
    return [k / a if a > 0 else 0.0 for k, a in zip(sums(kept, counts), whole, strict=True)]


def stage_outputs(profile: Profile, counts: Sequence[int]) -> list[float]:
    """Bytes each stage sends forward: the output of its last layer."""
    ends = [sum(counts[: s + 1]) - 1 for s in range(len(counts))]
    return [profile.layers[end].output_bytes for end in ends]


def program_traffic(
    program: Program, profile: Profile, counts: Sequence[int], micro_batches: int
) -> Traffic:
    """Bytes and messages between every pair of ranks in one iteration of N
    micro-batches (`program` may have fewer; its traffic is scaled): activations and
    gradients across stage boundaries, and a ring allreduce among each stage's replicas."""
    outputs = stage_outputs(profile, counts)
    weights = stage_weights(profile, counts)
    scale = micro_batches / max(program.num_microbatches, 1)
    traffic: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for pipeline in program.pipelines:
        carried = program.assignment.count(pipeline.name) * scale
        for stage in range(program.num_stages - 1):
            a, b = pipeline.placement[stage], pipeline.placement[stage + 1]
            if a != b:
                entry = traffic[(min(a, b), max(a, b))]
                entry[0] += 2 * carried * outputs[stage]
                entry[1] += 2 * carried
    for stage in range(program.num_stages):
        ring = sorted(set(program.replicas(stage)))
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            if a != b:
                entry = traffic[(min(a, b), max(a, b))]
                entry[0] += 2 * weights[stage]
                entry[1] += 2
    return {pair: (size, int(messages)) for pair, (size, messages) in traffic.items()}


def allreduce_end(
    program: Program,
    events: Iterable[Event],
    weights: Sequence[float],
    devices: Sequence[int],
    topology: Topology,
    copies: int = 1,
) -> float:
    """When the last replicated stage has summed its gradients (ms): each stage's
    allreduce starts after its last backward on all its replicas (eager sync) and takes
    2 log2(r) alpha + 2 (r-1)/r bytes beta over r replicas (Rabenseifner's algorithm, as
    in Chimera's performance model), alpha the largest latency and 1/beta the smallest
    bandwidth between them. 0 when no stage is replicated. With `copies` data-parallel
    copies of the program, copy k runs on `devices` shifted by k x len(devices), and
    every stage's replicas are those of all copies (they run alike, so one copy's events
    time them all)."""
    last: dict[int, float] = defaultdict(float)
    for event in events:
        action = event.action
        if action.kind in (Kind.B, Kind.W) and action.stage is not None:
            last[action.stage] = max(last[action.stage], event.end)
    end = 0.0
    for stage in range(program.num_stages):
        ranks = program.num_ranks  # process k x ranks + r runs rank r of copy k
        ring = sorted(
            {
                devices[p % ranks] + p // ranks * len(devices)
                for p in placement.reduce_ranks(program, stage, copies)
            }
        )
        if len(ring) < 2:
            continue
        links = [topology.link(a, b) for a, b in itertools.pairwise(ring)]
        alpha = max(link.latency for link in links)
        beta = 1 / min(link.bandwidth for link in links)
        r = len(ring)
        seconds = 2 * math.log2(r) * alpha + 2 * (r - 1) / r * weights[stage] * beta
        end = max(end, last[stage] + seconds * 1e3)
    return end


def peak_memory(
    program: Program, profile: Profile, counts: Sequence[int], state_factor: float
) -> list[float]:
    """Peak bytes of every rank: the weight state of its stage copies (weights x
    `state_factor`) plus the most activations it holds at once along its order (taken
    at F, freed at B, and where W is split, all but W's share at B and that at W: the
    profile's, `stage_w_shares`).
    In a schedule that recomputes (`R` before every B), F keeps only the stage's input
    and R takes the activations; both are freed together."""
    weights = stage_weights(profile, counts)
    activations = stage_activations(profile, counts)
    kept, recomputed = activations, None
    if Kind.R in program.kinds:
        kept, recomputed = [0.0, *stage_outputs(profile, counts)[:-1]], activations
    share, w = memory.shares(program), None
    if Kind.W in program.kinds:
        w_shares = stage_w_shares(profile, counts)
        w = lambda stage: w_shares[stage or 0]  # noqa: E731
    peaks = []
    for rank, actions in enumerate(program.ranks):
        state = sum(weights[s] for s, _ in program.stage_copies(rank)) * state_factor
        peaks.append(state + memory.peak_bytes(actions, w, kept, recomputed, share))
    return peaks
