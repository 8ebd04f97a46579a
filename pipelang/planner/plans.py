"""What the planner searches and finds: the inputs (`Inputs`), a candidate (a stdlib
schedule with its parameters, `candidates`), a plan (partition, devices, predicted time
and memory), a candidate left out with its reason, and the search's result."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from pipelang.planner.families import FAMILIES
from pipelang.planner.topology import Topology
from pipelang.planner.units import format_bytes
from pipelang.profile import Profile

FULL_OPS = 4_000
"""Schedules with at most this many ops are simulated at N directly, never extrapolated."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A stdlib schedule with all its parameters bound: D, N and the rest."""

    schedule: str
    params: tuple[tuple[str, int], ...]
    stages_per_rank: int
    dp: int = 1
    """Data-parallel copies of the pipeline (`pipelang run --dp`); N is per copy."""

    @property
    def ranks(self) -> int:
        return dict(self.params)["D"]

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    @property
    def label(self) -> str:
        dp = [f"dp={self.dp}"] if self.dp > 1 else []
        return " ".join([self.schedule, *(f"{k}={v}" for k, v in self.params), *dp])

    def with_n(self, n: int) -> Candidate:
        return replace(self, params=tuple((k, n if k == "N" else v) for k, v in self.params))


@dataclass(frozen=True, slots=True)
class Plan:
    """A candidate with its partition and mapping, and what the simulator predicts."""

    candidate: Candidate
    partition: tuple[int, ...]
    devices: tuple[int, ...]
    """Device (index into the topology) of every rank."""
    time_ms: float
    bubble_ratio: float
    memory: tuple[float, ...]
    """Peak bytes of every rank."""
    exact: bool
    """Simulated at N (True), or extrapolated from two smaller micro-batch counts."""
    split_w: bool
    transfer_ms: float
    """Mean time of one transfer between ranks (what the written `cost C` says)."""
    lopsided: str | None = None
    """Why the plan is degenerate (`lopsided`), or None."""

    def peak(self) -> tuple[float, int]:
        """The largest peak memory and its rank."""
        rank = max(range(len(self.memory)), key=self.memory.__getitem__)
        return self.memory[rank], rank


@dataclass(frozen=True, slots=True)
class Rejected:
    """A candidate left out, and why (a failed `require`, the memory cap, ...)."""

    candidate: Candidate
    reason: str
    memory: bool = False
    """Left out by the memory cap (rather than by the schedule or the model)."""
    time: bool = False
    """Left out by the time budget: it might have been the best."""


@dataclass(frozen=True, slots=True)
class SearchResult:
    plans: tuple[Plan, ...]
    rejected: tuple[Rejected, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class Inputs:
    """What a search needs: the model's layers, the cluster, N and the memory limit."""

    profile: Profile
    topology: Topology
    micro_batches: int
    max_memory: float | None = None
    optimizer: str = "adam"
    schedules: tuple[str, ...] = tuple(FAMILIES)
    data_parallel: bool = False
    """Also plan W copies of a pipeline on devices / W devices each (W > 1 dividing the
    device count and N), each copy running N / W micro-batches."""

    def cap(self, device: int) -> float:
        memory = self.topology.memory[device]
        return memory if self.max_memory is None else min(memory, self.max_memory)

    def over_cap(self, plan: Plan) -> str | None:
        """None when every rank's peak is under its device's cap, else the reason."""
        for rank, peak in enumerate(plan.memory):
            device = plan.devices[rank]
            cap = self.cap(device)
            if peak > cap:
                return (
                    f"needs {format_bytes(peak)} on rank {rank} "
                    f"({self.topology.names[device]}), over the cap of {format_bytes(cap)}"
                )
        return None

    def best(self, plans: Iterable[Plan]) -> Plan:
        """The fastest of `plans` that fits its devices (`over_cap`), else the fastest."""
        return min(plans, key=lambda plan: (self.over_cap(plan) is not None, plan.time_ms))

    def notes(self) -> list[str]:
        """What the user should know before trusting the plan: what the profile lacks,
        and a profile measured on another kind of device than the topology's."""
        notes = self.profile.notes()
        topology = self.topology
        other: dict[str, list[str]] = {}
        for device, name in enumerate(topology.names):
            kind = topology.kind_of(device)
            if kind and not self.profile.measured_on(kind):
                other.setdefault(kind, []).append(name)
        measured = self.profile.device + (
            f" ({self.profile.device_name})" if self.profile.device_name else ""
        )
        for kind, names in other.items():
            where = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
            notes.append(
                f"the profile was measured on {measured}, but the topology's `{kind}` "
                f"devices ({where}) are another kind: its layer times may not hold there; "
                "profile on that kind of device (`pipelang profile --device cuda` on it)"
            )
        return notes


def candidates(inputs: Inputs, dp: int = 1) -> list[Candidate]:
    """Every (schedule, D, other parameters) to try: D divides the device count; with
    `dp` copies (on a topology of one copy's devices), D is the device count."""
    found = []
    devices = inputs.topology.size
    for d in range(1, devices + 1):
        if devices % d or (dp > 1 and d != devices):
            continue
        for name in inputs.schedules:
            for extra, per_rank in FAMILIES[name](d):
                params = (("D", d), ("N", inputs.micro_batches), *extra)
                found.append(Candidate(name, params, per_rank, dp))
    return found


@dataclass
class Prediction:
    """The simulator's numbers for one candidate, partition and mapping at one N."""

    time_ms: float
    busy_ms: float
    memory: list[float]
    transfers: list[float] = field(default_factory=list)


class Leaders:
    """The times of the `size` fastest plans that fit, found so far by a search and the
    searches of its copies: a candidate bounded above the slowest of them is not
    simulated."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.times: list[float] = []

    def add(self, time_ms: float) -> None:
        self.times = sorted([*self.times, time_ms])[: self.size]

    def last(self) -> float:
        """The slowest of the leaders; infinite until there are `size` of them."""
        return self.times[-1] if len(self.times) == self.size else math.inf


LOPSIDED = 0.1
"""A stage with less than this share of the heaviest stage's work makes a plan lopsided."""


def lopsided(stage_costs: Sequence[tuple[float, float, float]]) -> str | None:
    """Why a partition is degenerate, from each stage's (F, B, W) time: some stage does
    less than `LOPSIDED` of the heaviest one's work, so its device waits nearly all the
    time; when every stage but one does, the pipeline is in effect one device per copy,
    which data parallelism over those devices may do better. None when it is not."""
    work = [sum(costs) for costs in stage_costs]
    heaviest = max(range(len(work)), key=work.__getitem__)
    light = [s for s, w in enumerate(work) if w < LOPSIDED * work[heaviest]]
    if not light:
        return None
    share = work[light[0]] / work[heaviest] if work[heaviest] > 0 else 0.0
    if len(light) == len(work) - 1:
        rest = 1 - work[heaviest] / sum(work)
        return (
            f"lopsided: the stages but stage {heaviest} do {rest:.0%} of the work, so this is "
            "in effect one device per pipeline, its other devices waiting nearly all the "
            "time; compare D=1, with `--data-parallel` copies on the other devices"
        )
    stages = ", ".join(map(str, light))
    return (
        f"lopsided: stage{'s' * (len(light) > 1)} {stages} do{'es' * (len(light) == 1)} "
        f"{share:.0%} of the work of stage {heaviest} or less: their devices wait nearly "
        "all the time"
    )
