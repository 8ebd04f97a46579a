"""Weight versions of an asynchronous schedule: which version every op reads, how many
versions each rank keeps, and how stale the gradients it applies are.

A schedule that declares `weights ...` updates each stage copy with `U` actions in its
ranks' orders instead of one `step` at the end. Each copy starts at version 0; its k-th
update (`Uk@s/p`, counted from 0) applies the gradients accumulated since the update
before and makes version k + 1. Walking each rank's order once:

- a forward (`F`) reads the copy's newest version where it stands in the order;
- a backward (`B`, `W`, `R`) reads, under `stash` and `K` buffers, the version its own
  forward read (weight stashing, PipeDream), and under `latest` the newest (PipeMare);
- a version is *live* while it is the newest or a micro-batch forwarded on it still
  awaits its last backward (`W` when the schedule splits it off, else `B`);
- a gradient's *delay* is how many updates separate the version its forward read from
  the version the update that applies it changes (PipeDream: D - 1 - s on stage s;
  PipeDream-2BW: at most 1).

    rank 0: F0@0/main F1@0/main B0@0/main U0@0/main F2@0/main B1@0/main U1@0/main ...
  =>
    F0, F1 read version 0; U0 makes version 1 while F1 still needs 0: 2 versions live;
    F2 reads 1; B1 reads 0 (stashed) and U1 applies it to version 1: a delay of 1.

Problems: E0313 for a `U` in a synchronous schedule, an asynchronous schedule with
replicas, or a gradient no update applies; E0314 for more live versions than `weights K`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pipelang.diagnostics import Diagnostic, Label
from pipelang.ir import Action, Kind, Program, WeightPolicy

Copy = tuple[int | None, str | None]
"""A stage copy: (stage, pipeline)."""

OpKey = tuple[Kind, int | None, int | None, str | None]
"""A compute op's identity: (kind, micro-batch, stage, pipeline)."""


@dataclass(frozen=True)
class WeightVersions:
    """What `weight_versions` finds; per-rank tuples are indexed by rank."""

    reads: dict[OpKey, int]
    """The version every compute op reads (0 everywhere in a synchronous schedule)."""
    peak: tuple[int, ...]
    """Per rank, the most weight versions live at once over all its stage copies."""
    delay: tuple[int, ...]
    """Per rank, the most updates by which a gradient it applies lags its weights."""
    problems: tuple[Diagnostic, ...] = field(default=())
    applies: dict[tuple[int | None, str | None, int], tuple[int | None, ...]] = field(
        default_factory=dict
    )
    """Per (stage, pipeline, k): the micro-batches whose gradients the copy's update k
    applies, in the order their last backward runs (empty in a synchronous schedule)."""

    def gradient_delays(self) -> dict[tuple[int, int, str], int]:
        """Per (micro-batch, stage, pipeline): how many updates lie between the version
        its forward read and the version its gradient is applied to (update k applies
        to version k). Weight prediction (XPipe) runs the forward on weights
        extrapolated over exactly these updates."""
        delays = {}
        for (stage, pipeline, k), mbs in self.applies.items():
            for mb in mbs:
                assert mb is not None and stage is not None and pipeline is not None
                delays[(mb, stage, pipeline)] = k - self.reads[(Kind.F, mb, stage, pipeline)]
        return delays


def weight_versions(program: Program) -> WeightVersions:
    """Versions, live counts, delays and problems of `program` (module docstring)."""
    policy = program.weights
    if policy is None:
        return WeightVersions(
            {},
            tuple(len(program.stage_copies(r)) for r in range(program.num_ranks)),
            (0,) * program.num_ranks,
            tuple(_synchronous_updates(program)),
        )
    problems = list(_replicas(program, policy))
    reads: dict[OpKey, int] = {}
    applies: dict[tuple[int | None, str | None, int], tuple[int | None, ...]] = {}
    peaks, delays = [], []
    for rank, actions in enumerate(program.ranks):
        walk = _RankWalk(program, policy, rank, reads)
        for action in actions:
            walk.step(action)
        problems += walk.problems
        problems += walk.unapplied()
        peaks.append(walk.peak)
        delays.append(walk.delay)
        applies.update(walk.applies)
    return WeightVersions(reads, tuple(peaks), tuple(delays), tuple(problems), applies)


def check_weights(program: Program) -> list[Diagnostic]:
    """E0313 and E0314 for `program` (see the module docstring)."""
    return list(weight_versions(program).problems)


def _synchronous_updates(program: Program) -> Iterable[Diagnostic]:
    """E0313 once per statement that puts a `U` in a schedule without `weights`."""
    seen = set()
    for actions in program.ranks:
        for action in actions:
            if action.kind is not Kind.U or action.span in seen:
                continue
            seen.add(action.span)
            yield Diagnostic(
                "E0313",
                f"`{action}` updates weights in a synchronous schedule",
                action.span,
                notes=(
                    "a synchronous schedule updates every stage once, after the whole "
                    "iteration (the compiler adds that `step`)",
                ),
                help="declare how the schedule versions its weights: `weights stash`, "
                "`weights latest` or `weights 2`; or remove the `U`",
            )


def _replicas(program: Program, policy: WeightPolicy) -> Iterable[Diagnostic]:
    if len(program.pipelines) > 1:
        names = ", ".join(f"`{p.name}`" for p in program.pipelines)
        yield Diagnostic(
            "E0313",
            f"an asynchronous schedule has one pipeline; this one has {names}",
            policy.span,
            help="replicas would need their gradients synchronised before each update; "
            "remove the `weights` line or keep one pipeline",
        )


class _RankWalk:
    """One rank's order, action by action: the state of each of its stage copies."""

    def __init__(
        self, program: Program, policy: WeightPolicy, rank: int, reads: dict[OpKey, int]
    ) -> None:
        self.policy = policy
        self.rank = rank
        self.reads = reads
        self.last = Kind.W if Kind.W in program.kinds else Kind.B
        self.copies: list[Copy] = list(program.stage_copies(rank))
        self.newest: dict[Copy, int] = defaultdict(int)
        self.pinned: dict[Copy, Counter[int]] = defaultdict(Counter)
        self.forwards: dict[tuple[int | None, Copy], Action] = {}
        self.pending: dict[Copy, list[tuple[Action, int]]] = defaultdict(list)
        self.over: set[Copy] = set()
        self.applies: dict[tuple[int | None, str | None, int], tuple[int | None, ...]] = {}
        self.peak = self.live_total()
        self.delay = 0
        self.problems: list[Diagnostic] = []

    def live(self, copy: Copy) -> set[int]:
        """The versions of `copy` in memory now."""
        return {self.newest[copy], *self.pinned[copy]}

    def live_total(self) -> int:
        return sum(len(self.live(copy)) for copy in self.copies)

    def step(self, action: Action) -> None:
        kind = action.kind
        copy = (action.stage, action.pipeline)
        if kind is Kind.U:
            self.update(action, copy)
        elif kind is Kind.F:
            version = self.newest[copy]
            self.reads[(kind, action.mb, *copy)] = version
            if self.policy.stashes:
                self.forwards[(action.mb, copy)] = action
                self.pinned[copy][version] += 1
        elif kind.is_compute:
            self.backward(action, copy)
        self.peak = max(self.peak, self.live_total())

    def backward(self, action: Action, copy: Copy) -> None:
        forward = self.reads.get((Kind.F, action.mb, *copy), self.newest[copy])
        stashed = self.policy.stashes and (action.mb, copy) in self.forwards
        self.reads[(action.kind, action.mb, *copy)] = forward if stashed else self.newest[copy]
        if action.kind is not self.last:
            return
        self.pending[copy].append((action, forward))
        if stashed:
            del self.forwards[(action.mb, copy)]
            pins = self.pinned[copy]
            pins[forward] -= 1
            if not pins[forward]:  # only pinned versions stay: `live` runs at every op
                del pins[forward]

    def update(self, action: Action, copy: Copy) -> None:
        grads = self.pending.pop(copy, [])
        self.applies[(*copy, action.mb or 0)] = tuple(a.mb for a, _ in grads)
        for _, forward in grads:
            self.delay = max(self.delay, self.newest[copy] - forward)
        self.newest[copy] += 1
        limit = self.policy.limit
        if limit is not None and copy not in self.over and len(self.live(copy)) > limit:
            self.over.add(copy)
            self.problems.append(self.too_many(action, copy, limit))

    def too_many(self, action: Action, copy: Copy, limit: int) -> Diagnostic:
        live = sorted(self.live(copy))
        holders = sorted(
            (self.reads[(Kind.F, mb, *c)], f)
            for (mb, c), f in self.forwards.items()
            if c == copy and self.reads[(Kind.F, mb, *c)] != self.newest[copy]
        )
        oldest = holders[0][1] if holders else None
        labels = []
        if oldest is not None and oldest.span is not None:
            labels.append(Label(oldest.span, f"`{oldest}` read version {holders[0][0]}"))
        if self.policy.span is not None:
            labels.append(Label(self.policy.span, f"at most {limit} versions"))
        waiting = ", ".join(f"`{f}` (version {v})" for v, f in holders[:3])
        return Diagnostic(
            "E0314",
            f"`{action}` makes version {self.newest[copy]} of stage {copy[0]} on rank "
            f"{self.rank} while {len(live)} versions are live ({_versions(live)}); "
            f"`weights {limit}` allows {limit}",
            action.span,
            tuple(labels),
            notes=(f"micro-batches still awaiting their backward: {waiting}",),
            help="update after more micro-batches (at least as many as are in flight), "
            "or declare `weights stash`",
        )

    def unapplied(self) -> Iterable[Diagnostic]:
        """E0313 for each copy whose last gradients no update applies."""
        for copy, grads in sorted(self.pending.items(), key=lambda item: str(item[0])):
            if not grads:
                continue
            last = grads[-1][0]
            yield Diagnostic(
                "E0313",
                f"rank {self.rank} never applies the gradient of `{last}`"
                + (f" and {len(grads) - 1} more" if len(grads) > 1 else ""),
                last.span,
                help=f"add a `U()` after it: no update of stage {copy[0]} follows it "
                f"on rank {self.rank}",
            )


def _versions(live: list[int]) -> str:
    return ", ".join(map(str, live))
