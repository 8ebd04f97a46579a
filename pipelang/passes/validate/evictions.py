"""Evicted activations (BPipe): the checks `validate` runs on `E` and `L` actions (the
memory they move over time is `memory.peak_over_time`).

`E(i) -> rank p` sends the activations `F(i)` kept to rank p, and `L(i)` takes them back
on the rank that evicted them. An eviction is well formed when, for its (micro-batch,
stage), on the rank that runs the forward:

    F ... E ... L ... B        (and any R after the L: it needs the activations too)

with exactly one `E` and one `L`, and the partner another rank of the schedule.

- E0301: an `E` or `L` on a rank that does not run the forward;
- E0302: an `E` or `L` listed twice;
- E0315: an `E` never loaded back, an `L` with no `E`, an `E` before its `F`, an `L`
  before its `E`, a `B` or `R` before the `L`;
- E0316: the partner is the evicting rank itself, or no rank of the schedule.

    rank 0: F0@0/main E0@0/main>3 B0@0/main
  =>
    error[E0315]: `E0@0/main>3` is never loaded back
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pipelang.diagnostics import Diagnostic, label
from pipelang.ir import Action, Kind, Program, placement
from pipelang.passes.validate.problems import Problem, collapse

Key = tuple[int | None, int | None, str | None]
"""(micro-batch, stage, pipeline) of a forward's activations."""


@dataclass
class _Stash:
    """Where one forward's activations are evicted and loaded: (rank, step, action) of
    each `E` and `L` listed for them, and the steps of F, R and B on the owner rank."""

    evicts: list[tuple[int, int, Action]] = field(default_factory=list)
    loads: list[tuple[int, int, Action]] = field(default_factory=list)
    steps: dict[Kind, tuple[int, Action]] = field(default_factory=dict)


def check_evictions(program: Program) -> list[Diagnostic]:
    """E0301, E0302, E0315, E0316 for the `E` and `L` actions of `program` (see the
    module docstring); empty when it has none or they are all well formed."""
    stashes = _collect(program)
    if not stashes:
        return []
    owner = placement.owners(program.pipelines)
    problems: list[Problem] = []
    for key, stash in stashes.items():
        problems += _check_one(program, owner.get((key[1], key[2])), stash)
    return collapse(problems, _MANY)


def _collect(program: Program) -> dict[Key, _Stash]:
    """Every evicted or loaded forward, with the steps of its own F, R and B."""
    stashes: dict[Key, _Stash] = defaultdict(_Stash)
    for rank, actions in enumerate(program.ranks):
        for step, action in enumerate(actions):
            if action.kind is Kind.E:
                stashes[action[1:4]].evicts.append((rank, step, action))
            elif action.kind is Kind.L:
                stashes[action[1:4]].loads.append((rank, step, action))
    if not stashes:
        return {}
    owner = placement.owners(program.pipelines)
    for rank, actions in enumerate(program.ranks):
        for step, action in enumerate(actions):
            key = action[1:4]
            if (
                action.kind in (Kind.F, Kind.R, Kind.B)
                and key in stashes
                and owner.get((action.stage, action.pipeline)) == rank
            ):
                stashes[key].steps.setdefault(action.kind, (step, action))
    return dict(stashes)


def _check_one(program: Program, owner: int | None, stash: _Stash) -> list[Problem]:
    problems = [
        _misplaced(action, rank, owner)
        for rank, _, action in (*stash.evicts, *stash.loads)
        if rank != owner
    ]
    for listed in (stash.evicts, stash.loads):
        problems += [_twice(listed[0], again) for again in listed[1:]]
    for rank, _, action in stash.evicts:
        partner = _bad_partner(program, rank, action)
        if partner is not None:
            problems.append(partner)
    if problems:
        return problems
    if not stash.loads:
        return [_never_loaded(stash.evicts[0][2])]
    if not stash.evicts:
        return [_never_evicted(stash.loads[0][2])]
    return _out_of_order(stash)


def _misplaced(action: Action, rank: int, owner: int | None) -> Problem:
    forward = Action(Kind.F, action.mb, action.stage, action.pipeline)
    where = "no rank" if owner is None else f"rank {owner}"
    return Problem(
        "E0301",
        action,
        -1,
        f"`{action}` is listed on rank {rank}, but `{forward}` keeps its activations on {where}",
        f"evict and load them on {where}, the rank that runs `{forward}`",
        what="misplaced",
    )


def _twice(first: tuple[int, int, Action], again: tuple[int, int, Action]) -> Problem:
    return Problem(
        "E0302",
        again[2],
        -1,
        f"`{again[2]}` is listed twice: rank {first[0]} step {first[1]} "
        f"and rank {again[0]} step {again[1]}",
        "evict a forward's activations once, and load them back once",
        label(first[2].span, "first listed here"),
        what="twice",
    )


def _bad_partner(program: Program, rank: int, action: Action) -> Problem | None:
    peer = action.peer
    if peer is not None and peer != rank and 0 <= peer < program.num_ranks:
        return None
    why = (
        f"evicts to rank {peer}, the rank that evicts"
        if peer == rank
        else f"evicts to rank {peer}, but the ranks are 0..{program.num_ranks}"
    )
    return Problem(
        "E0316",
        action,
        -1,
        f"`{action}` {why}",
        "evict to another rank of the schedule, e.g. the partner `D - 1 - r`",
        what="partner",
    )


def _never_loaded(evict: Action) -> Problem:
    return Problem(
        "E0315",
        evict,
        -1,
        f"`{evict}` is never loaded back",
        f"add `L({evict.mb})` before `B({evict.mb})` on this rank: the backward needs "
        "the activations",
        what="never loaded",
    )


def _never_evicted(load: Action) -> Problem:
    return Problem(
        "E0315",
        load,
        -1,
        f"`{load}` loads activations that no `E` evicted",
        f"remove it, or evict them first: `E({load.mb}) -> rank p` after `F({load.mb})`",
        what="never evicted",
    )


def _out_of_order(stash: _Stash) -> list[Problem]:
    """E before its F, L before its E, and an R or B of the forward before the L."""
    (_, evict_step, evict), (_, load_step, load) = stash.evicts[0], stash.loads[0]
    problems = []
    forward = stash.steps.get(Kind.F)
    if forward is not None and forward[0] > evict_step:
        problems.append(_before("E before F", evict, forward[1], "evicts before its forward"))
    if evict_step > load_step:
        problems.append(_before("L before E", load, evict, "loads before its eviction"))
    for kind in (Kind.R, Kind.B):
        needer = stash.steps.get(kind)
        if needer is not None and needer[0] < load_step:
            problems.append(_too_late(load, needer[1]))
    return problems


def _before(what: str, action: Action, other: Action, says: str) -> Problem:
    return Problem(
        "E0315",
        action,
        -1,
        f"`{action}` {says} `{other}`",
        f"list `{other}` before `{action}`",
        label(other.span, "listed here"),
        what=what,
    )


def _too_late(load: Action, needer: Action) -> Problem:
    return Problem(
        "E0315",
        load,
        -1,
        f"`{load}` loads the activations back after `{needer}`, which needs them",
        f"list `{load}` before `{needer}`",
        label(needer.span, "needs the activations here"),
        what="loaded late",
    )


_MANY = {
    "misplaced": "evictions or loads are on the wrong rank",
    "twice": "evictions or loads are listed twice",
    "partner": "evictions name a bad partner",
    "never loaded": "evictions are never loaded back",
    "never evicted": "loads have no eviction",
    "E before F": "evictions come before their forward",
    "L before E": "loads come before their eviction",
    "loaded late": "loads come after the op that needs them",
}
