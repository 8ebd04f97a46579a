"""Held activations: the one rule for what a rank keeps between a forward and its backward.

A forward `F` takes its activations; its `B` frees them. Where the backward is split
(ops `F, B, W`), B frees all but the share its `W` still reads, each weighted layer's
input and output gradient (the cost model's `MW`, per stage, default `ir.MW_SHARE`),
and W frees that: the zero-bubble paper's M_B and M_W (arXiv 2401.10241, Table 2; the
runtime releases the rest after B, backends/weight_split.py). An eviction `E` hands the
activations to a partner and its load `L` brings them back. A recompute `R` rebuilds
what its F dropped: counted in forwards it changes nothing (the F is still held);
counted in bytes it adds the stage's activations over the stage input the F kept.

Where a rank's `W` comes right after its `B` (`ir.program.whole_backwards`: nothing but
receives between them), the runtime runs one whole backward at B and keeps nothing for
W, so B frees everything and W nothing (`w_kept`): the same peak where W's share is at
most 1 (every cost model's `MW`), lower where the gradients W would keep outweigh what
B releases (a measured share over 1, `simulate --model`: gpt:tiny's first stage). The
orders that place W themselves (squeeze, synthesis) count each pair split with `change`:
never below this count.

Counts are in micro-batches: with sequence chunks (`chunks C`), a chunk's forward holds
its share of the micro-batch's tokens (`Chunks.tokens`), so a chunked schedule compares
with an unchunked one directly, and more: past the first chunk, its attention
concatenates the keys and values of the chunks before it with its own and saves that for
the backward, the stage's `KV` share of the activations times the tokens up to the
chunk's end (the cost model's `KV`, 0.12 by default). Backwards run last chunk first, so
all of it is freed by the chunk's own backward. With micro-batches of different shapes
(`lengths`), one holds its tokens over the reference micro-batch's (`BatchShapes.memory`).

Everything that counts activations asks here: `simulate` (peak activations; with
evictions over time, the partner's side too, `peak_over_time`; in bytes with
`--model`), `validate` (`--max-activations`, E0308), the squeeze orders (their memory
bound) and the planner (peak bytes).

    held([F0, F1, B0, F2, B1, B2])  ->  1 2 1 2 1 0
    held([F0, F1, B0, B1, W0, W1], MW = 0.4)  ->  1 2 1.4 0.8 0.4 0
    held([F0, F1, B0, W0, B1, W1], MW = 0.4)  ->  1 2 1 1 0 0      (whole backwards)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pipelang.ir import Action, CostModel, Kind, Program
from pipelang.ir.program import whole_backwards

if TYPE_CHECKING:
    from pipelang.sim.timeline import Event


WShare = Callable[[int | None], float]
"""What W still reads of a stage's activations after B, as a share (`w_share`)."""


def w_share(program: Program, costs: CostModel | None = None) -> WShare | None:
    """Per stage, the share of a forward's activations its W reads after B (the cost
    model's `MW`; `costs` stands for the schedule's own); None when the backward is not
    split, so B frees everything."""
    return kinds_w_share(program.kinds, program.costs if costs is None else costs)


def kinds_w_share(kinds: Iterable[Kind], costs: CostModel) -> WShare | None:
    """`w_share` for a schedule of these op kinds under `costs`."""
    if Kind.W not in kinds:
        return None
    return lambda stage: costs.of("MW", stage)


Kept = Callable[[Action], float | None]
"""What W reads after B of an action's forward, for `change` (`w_kept`)."""


def w_kept(actions: Iterable[Action], w: WShare | None) -> Kept:
    """Per action of one rank's `actions`, what its W reads after its B: `w` of its
    stage, or None where the backward is not split or where the rank runs it whole
    (`whole_backwards`), so that B frees everything. The one place the count asks."""
    if w is None:
        return lambda action: None
    whole = whole_backwards(actions)
    if not whole:
        return lambda action: w(action.stage)

    def share(action: Action) -> float | None:
        key = (action.mb, action.stage, action.pipeline, action.chunk)
        return None if key in whole else w(action.stage)

    return share


def change(kind: Kind, kept: float | None = None) -> float:
    """How an op of `kind` changes the forwards its rank holds: +1 at F and at a load L,
    -1 at an eviction E; -1 at B, or where W is split off, -(1 - kept) at B and -kept
    at W (`kept`: what W reads after B; 1 counts a forward until its W)."""
    if kind is Kind.F or kind is Kind.L:
        return 1
    if kind is Kind.E:
        return -1
    if kind is Kind.B:
        return -1 if kept is None else kept - 1
    if kind is Kind.W and kept is not None:
        return -kept
    return 0


Share = Callable[[Action], float]
"""What one forward's activations count for, in micro-batches (`shares`)."""


def shares(program: Program, costs: CostModel | None = None) -> Share | None:
    """What each forward's activations count for, in micro-batches: a chunk its share of
    the tokens (`Chunks.tokens`) plus, past the first chunk, its stage's `KV` share times
    the tokens up to its end (the keys and values it saves concatenated), a shaped
    micro-batch its tokens over the reference's (`BatchShapes.memory`), both multiplied;
    None when every forward counts 1. `costs` stands for the schedule's own (a
    `--cost A=...,KV=...` from the command line)."""
    chunks, shapes = program.chunks, program.shapes
    if chunks is None and shapes is None:
        return None
    costs = program.costs if costs is None else costs
    parts: dict[int | None, tuple[float, ...]] = {}
    if chunks is not None:
        bounds = chunks.bounds(costs.of("A"))
        for stage in costs.stages() | {None}:
            kv = costs.of("KV", stage)
            parts[stage] = tuple(
                bounds[c + 1] - bounds[c] + (kv * bounds[c + 1] if c else 0.0)
                for c in range(chunks.count)
            )
    reference = 1.0 if shapes is None else shapes.reference(costs)

    def share(action: Action) -> float:
        part = 1.0
        if action.chunk is not None:
            part = parts.get(action.stage, parts[None])[action.chunk]
        if shapes is not None and action.mb is not None:
            part *= shapes.memory(action.mb, reference)
        return part

    return share


def held(
    actions: Iterable[Action], w: WShare | None = None, share: Share | None = None
) -> Iterator[float]:
    """After each action, how many forwards (micro-batches) the rank holds; `w` is what
    W reads after B (`w_share`), `share` what each forward counts for (`shares`) where
    they differ."""
    actions = tuple(actions)
    kept_by = w_kept(actions, w)
    count: float = 0
    for action in actions:
        delta = change(action.kind, kept_by(action))
        count += delta * share(action) if delta and share is not None else delta
        yield count


def peak(actions: Iterable[Action], w: WShare | None = None, share: Share | None = None) -> float:
    """The most forwards (micro-batches) the rank holds at once along `actions`."""
    return max(held(actions, w, share), default=0)


def holding(actions: Iterable[Action], w: WShare | None = None) -> list[Action]:
    """The forwards (or loads) still held, whole or their W's share, after the last of
    `actions`, oldest first: who makes up the count `held` gives, for messages."""
    actions = tuple(actions)
    kept_by = w_kept(actions, w)
    found: dict[tuple[int | None, int | None, str | None, int | None], Action] = {}
    for action in actions:
        key = (action.mb, action.stage, action.pipeline, action.chunk)
        kind = action.kind
        if kind is Kind.F or kind is Kind.L:
            found[key] = action
        elif kind is Kind.E or kind is (Kind.W if kept_by(action) else Kind.B):
            found.pop(key, None)
    return list(found.values())


def peak_bytes(
    actions: Iterable[Action],
    w: WShare | None,
    kept: Sequence[float],
    recomputed: Sequence[float] | None = None,
    share: Share | None = None,
) -> float:
    """The most bytes of activations held at once along `actions`: `kept[stage]` from a
    forward, and with recomputation also `recomputed[stage]` from its R, until B frees
    them (all, or where W is split off all but W's share `w`, which W frees); where
    forwards differ (`shares`), each its share of either."""
    actions = tuple(actions)
    kept_by = w_kept(actions, w)
    total = top = 0.0
    for action in actions:
        stage = action.stage or 0
        kind = action.kind
        part = 1.0 if share is None else share(action)
        whole = kept[stage] + (recomputed[stage] if recomputed is not None else 0.0)
        if kind is Kind.F or kind is Kind.L:
            total += part * kept[stage]
        elif kind is Kind.E:
            total -= part * kept[stage]
        elif kind is Kind.R and recomputed is not None:
            total += part * recomputed[stage]
        elif kind is Kind.B or kind is Kind.W:
            kept_by_w = kept_by(action) or 0.0
            total -= part * whole * (1 - kept_by_w if kind is Kind.B else kept_by_w)
        top = max(top, total)
    return top


def peak_over_time(
    program: Program,
    events: Sequence[Event],
    w: WShare | None = None,
    share: Share | None = None,
) -> list[float] | None:
    """Per rank, the most activations kept at once over a timeline of `program` in which
    something is evicted; None when nothing is.

    Along its own order a rank keeps a forward's activations from the start of its `F` to
    the end of its `B` (where W is split off, W's share `w` to the end of its `W`), except
    from the end of its `E` to the start of its `L`; the partner keeps them from the end
    of the `E` to the end of the `L` (until they are back). Each forward counts its
    `share` where they differ, as in `held`. At one instant, what the partner hands back
    goes first, then the rank's own actions in order, then what it receives. Without
    evictions this is the count along the order, `peak`.
    """
    if len(events) == program.num_microbatches * program.num_stages * len(program.kinds):
        return None  # a valid program with no stash actions (the usual case)
    loads = {e.action[1:4]: e for e in events if e.action.kind is Kind.L}
    changes: list[list[tuple[float, int, int, float]]] = [[] for _ in program.ranks]
    kept_by = [w_kept(actions, w) for actions in program.ranks]
    evicted = False
    for seq, event in enumerate(events):
        action = event.action
        kind, rows = action.kind, changes[event.rank]
        part = 1.0 if share is None else share(action)
        delta = change(kind, kept_by[event.rank](action)) * part
        if delta:  # taken as the op starts, freed (or handed over) once it ends
            rows.append((event.start if delta > 0 else event.end, 1, seq, delta))
        if kind is Kind.E:
            load, peer = loads.get(action[1:4]), action.peer
            if load is not None and peer is not None and 0 <= peer < len(changes):
                changes[peer].append((event.end, 2, seq, part))
                changes[peer].append((load.end, 0, seq, -part))
                evicted = True
    if not evicted:
        return None
    return [max(itertools.accumulate(d for *_, d in sorted(rows)), default=0) for rows in changes]
