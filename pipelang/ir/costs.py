"""How long ops take and what they hold: `CostModel` (a schedule's `cost` line and
`--cost`, with the one rule for a cost entry's range, `cost_problem`), sequence `Chunks`
and micro-batch `BatchShapes` with the share of a micro-batch's work each takes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pipelang.diagnostics import quote
from pipelang.ir import deps
from pipelang.ir.action import STASH_KINDS, Action, Kind
from pipelang.source import Span

SHARD_COSTS = {Kind.GATHER: "AG", Kind.REDUCE_SCATTER: "RS"}
"""The cost entry that times each of a sharded stage's collectives (`--shard`)."""


@dataclass(frozen=True, slots=True)
class Chunks:
    """How a schedule splits every micro-batch into sequence chunks (`chunks C`).

    A chunk is a contiguous span of a micro-batch's tokens. Its forward on a stage needs
    the keys and values of the chunks before it on that stage, and its backward hands
    their gradients back, so backwards run last chunk first. `split` says how the spans
    are cut: `tokens` (equal lengths) or `compute` (equal work; later chunks are shorter,
    since they attend to a longer prefix). Work depends on the share `attention` of a
    whole micro-batch's op spent in attention (the cost model's `A`): a span over the
    token fractions [a, b) does `(1 - A) * (b - a) + A * (b^2 - a^2)` of the op's work,
    causal attention growing with the square of the prefix.
    """

    count: int
    split: str = "tokens"
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def bounds(self, attention: float) -> tuple[float, ...]:
        """The chunks' boundaries as fractions of the sequence: count + 1 values, 0 to 1."""
        n = self.count
        if self.split == "tokens" or attention <= 0.0:
            return tuple(c / n for c in range(n + 1))
        a = attention  # solve (1 - a) t + a t^2 = c / n for t; the last cut is the end
        cuts = [
            ((1 - a) ** 2 + 4 * a * c / n) ** 0.5 / (2 * a) - (1 - a) / (2 * a) for c in range(n)
        ]
        return (*cuts, 1.0)

    def tokens(self, attention: float) -> tuple[float, ...]:
        """Each chunk's share of the micro-batch's tokens (and so of its activations)."""
        b = self.bounds(attention)
        return tuple(b[c + 1] - b[c] for c in range(self.count))

    def work(self, attention: float) -> tuple[float, ...]:
        """Each chunk's share of a whole micro-batch's op time."""
        b, a = self.bounds(attention), attention
        return tuple(
            (1 - a) * (b[c + 1] - b[c]) + a * (b[c + 1] ** 2 - b[c] ** 2) for c in range(self.count)
        )

    def token_bounds(self, length: int, attention: float) -> tuple[int, ...]:
        """The boundaries in tokens for a sequence of `length` (each chunk at least one
        token; ValueError when the sequence is shorter than the chunks)."""
        if length < self.count:
            raise ValueError(f"{self.count} chunks need a sequence of at least {self.count} tokens")
        cuts = [round(t * length) for t in self.bounds(attention)]
        for c in range(1, self.count + 1):  # at least one token each, from the front
            cuts[c] = max(cuts[c], cuts[c - 1] + 1)
        for c in range(self.count - 1, 0, -1):  # and from the back
            cuts[c] = min(cuts[c], cuts[c + 1] - 1)
        return tuple(cuts)


@dataclass(frozen=True, slots=True)
class BatchShapes:
    """Micro-batches that differ in shape (DynaPipe): micro-batch i holds `samples[i]`
    sequences of `lengths[i]` tokens (padded to it). Its ops take the time and memory of
    that shape, relative to the cost model's reference, one sequence of `S` tokens (the
    longest length when the model gives no `S`): the linear work grows with its tokens,
    attention's share `A` with samples x length^2.
    """

    samples: tuple[int, ...]
    lengths: tuple[int, ...]
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    def reference(self, costs: CostModel) -> float:
        """The tokens of the reference sequence: the cost model's `S`, else the longest."""
        given = costs.of("S")
        return given if given > 0 else float(max(self.lengths))

    def tokens(self, mb: int) -> int:
        return self.samples[mb] * self.lengths[mb]

    def work(self, mb: int, attention: float, reference: float, fixed: float = 0.0) -> float:
        """Micro-batch `mb`'s op time over the reference's (`shape_work`)."""
        return shape_work(self.samples[mb], self.lengths[mb], attention, reference, fixed)

    def memory(self, mb: int, reference: float) -> float:
        """Micro-batch `mb`'s activations over the reference's: its tokens over `S`."""
        return self.tokens(mb) / reference


def shape_work(
    samples: int, length: int, attention: float, reference: float, fixed: float = 0.0
) -> float:
    """The op time of a micro-batch of `samples` sequences of `length` tokens over the
    reference's (one sequence of `reference` tokens):
    `O + (1 - O) ((1 - A) n / S + A s l^2 / S^2)` for its n = s x l tokens, where `O`
    (`fixed`) is the share of the reference's time that does not shrink with a smaller
    micro-batch (launches, latency) and `A` attention's share."""
    n = samples * length
    scaled = (1 - attention) * n / reference + attention * n * length / reference**2
    return fixed + (1 - fixed) * scaled


KV_SHARE = 0.12
"""A transformer block's keys and values over its saved activations: 4sbh of 34sbh
(Korthikanti et al., arXiv 2205.05198, §4.1), 0.118 measured on gpt:tiny's block."""

MW_SHARE = 1.0
"""What a split backward's W still reads of a stage's saved activations after its B
(each weighted layer's input and output gradient), as a share: 0.99 measured on the
blocks of gpt:tiny and gpt:small (`pipelang profile`'s `w_activation_bytes`), whose
attention saves no score matrix, so W's GEMM inputs and output gradients are about all
B kept (the zero-bubble paper's 32sbh of 34sbh); 0.43 in the paper's setting, where
the attention probabilities are saved (arXiv 2401.10241, Table 1)."""

MAX_TIME = 1e15
"""The largest time a cost model takes: sums over 10^6 ops stay finite (and JSON)."""


COST_KINDS = ("F", "B", "W", "R", "P", "C", "FB", "E", "L", "AG", "RS", "A", "S", "O", "KV", "MW")
"""Every cost entry's name: the times of op kinds, a transfer (`C`), an overlapped pair
(`FB`), an eviction's trips (`E`, `L`), a sharded stage's all-gather (`AG`) and
reduce-scatter (`RS`), and the shares and sizes `A`, `S`, `O`, `KV`,
`MW`. The one list: a `cost` line's names, `--cost` and the API's costs are checked
against it (`cost_name_problem`)."""


def cost_name_problem(name: object) -> str | None:
    """What is wrong with `name` as a cost entry's name, None when nothing."""
    if name in COST_KINDS:
        return None
    shown = quote(name if isinstance(name, str) else repr(name))
    return f"no cost {shown}; costs are {', '.join(COST_KINDS)}"


def cost_problem(kind: str, value: float) -> str | None:
    """What is wrong with cost entry `kind = value`, None when nothing: the one rule for
    `cost` lines, `--cost` and the API's costs. A time is 0 to 10^15; `A`, `O`, `KV` and
    `MW` are shares, 0 to 1; `S` is tokens, 0 (the longest micro-batch) or at least 1."""
    if not 0 <= value <= MAX_TIME:  # NaN fails too
        return f"`{kind}` is {value:g}; a time is between 0 and 10^15"
    if kind in ("A", "O") and value > 1:
        return f"`{kind}` is a share of an op's work, between 0 and 1, not {value:g}"
    if kind in ("KV", "MW") and value > 1:
        return f"`{kind}` is a share of a stage's activations, between 0 and 1, not {value:g}"
    if kind == "S" and 0 < value < 1:
        return f"`S` is the reference's tokens, 0 (the longest) or at least 1, not {value:g}"
    return None


def stage_problem(kind: str, stage: int, num_stages: int) -> str | None:
    """What is wrong with a cost entry `kind[stage]` for a schedule of `num_stages`
    stages, None when nothing: the one rule for `cost` lines, `--cost` and
    `synthesize`. `C[b]` names the boundary between stages b and b + 1."""
    if kind == "C":
        if not 0 <= stage < num_stages - 1:
            return (
                f"`C[{stage}]` names no stage boundary: `C[b]` is the link between stages b "
                f"and b + 1, and the schedule's boundaries are 0..{num_stages - 2}"
            )
        return None
    if not 0 <= stage < num_stages:
        return f"the schedule has no stage {stage} (its stages are 0..{num_stages - 1})"
    return None


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time of each op kind (`F`, `B`, `W`, `R`, `P`), of one transfer (`C`; `C[b]` the
    link between stages b and b + 1, `transfer`), and of an
    overlapped forward-backward pair (`FB`, for the forward's stage; without it a pair
    takes the sum of its ops). `A` is no time but a share: how much of an op's work on
    a whole micro-batch is attention, which splits it over sequence chunks (`Chunks`)
    and scales it with micro-batch shapes (`BatchShapes`); `S` is no time either: the
    tokens of the reference micro-batch the times are for, with shapes (0: the longest),
    and `O` the share of the reference's time that a smaller micro-batch still takes.
    `KV` is memory, not time: the share of a stage's activations that are attention keys
    and values, which a sequence chunk's forward past the first saves again, concatenated
    with the chunks' before it (`KV_SHARE` by default, `memory.shares`). `MW` is memory
    too: the share of a stage's activations that a split backward's W still reads after
    its B (`MW_SHARE` by default, `memory.w_share`). `AG` and `RS` time a sharded
    stage copy's all-gather (`gather`) and reduce-scatter (`reduce_scatter`), on its
    rank, between its other ops (`--shard`; 0 unless given).

    Entries are (kind, stage or None, time); a later entry overrides an earlier one, and a
    per-stage entry overrides a per-kind one. Unit costs by default, transfers free.
    """

    entries: tuple[tuple[str, int | None, float], ...] = (
        ("F", None, 1.0),
        ("B", None, 1.0),
        ("W", None, 0.0),
        ("R", None, 1.0),
        ("P", None, 1.0),
        ("C", None, 0.0),
        ("A", None, 0.0),
        ("S", None, 0.0),
        ("O", None, 0.0),
        ("KV", None, KV_SHARE),
        ("MW", None, MW_SHARE),
    )
    _table: dict[tuple[str, int | None], float] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    """The last entry of every (kind, stage), so that `of` is one lookup: a plan or a
    greedy order asks it once per op, of a model with an entry per stage."""

    def __post_init__(self) -> None:
        for name, stage, value in self.entries:
            self._table[(name, stage)] = value

    def of(self, kind: str, stage: int | None = None) -> float:
        """The time of `kind` (`F`, `B`, `W`, `R`, `P` or `C`) on `stage`."""
        if stage is not None:
            found = self._table.get((kind, stage))
            if found is not None:
                return found
        return self._table.get((kind, None), 0.0)

    def time(self, op: Action) -> float:
        """How long one op runs: its kind's time on its stage. Stash ops (E, L, H) take
        none here: moving evicted activations is timed on the transfers, like `C`. (A
        compound's time, `FB` or the sum of its ops, is the simulator's.) A sharded
        copy's `gather` takes `AG`, its `reduce_scatter` `RS`, its `reshard` nothing
        (it frees memory)."""
        kind = op.kind
        if kind in STASH_KINDS or kind is Kind.RESHARD:
            return 0.0
        return self.of(SHARD_COSTS.get(kind) or kind.value, op.stage)

    def timer(
        self, chunks: Chunks | None, shapes: BatchShapes | None = None
    ) -> Callable[[Action], float]:
        """`time`, for a schedule split into `chunks` or with micro-batches of different
        `shapes`: an op on a chunk takes the chunk's share of its kind's time
        (`Chunks.work`, with the stage's attention share `A`), an op of a shaped
        micro-batch its shape's multiple (`BatchShapes.work`)."""
        if chunks is None and shapes is None:
            return self.time
        stages = self.stages() | {None}
        shares = {
            stage: (1.0,) if chunks is None else chunks.work(self.of("A", stage))
            for stage in stages
        }
        factors: dict[tuple[int | None, int], float] = {}
        if shapes is not None:
            reference = shapes.reference(self)
            factors = {
                (stage, mb): shapes.work(mb, self.of("A", stage), reference, self.of("O", stage))
                for stage in stages
                for mb in range(len(shapes.lengths))
            }

        def time(op: Action) -> float:
            base = self.time(op)
            if op.chunk is not None:
                base *= shares.get(op.stage, shares[None])[op.chunk]
            if factors and op.mb is not None and op.kind.is_compute:
                base *= factors.get((op.stage, op.mb)) or factors[(None, op.mb)]
            return base

        return time

    def transfer(self, op: Action) -> float:
        """How long `op`'s result takes to reach the rank of the stage that reads it: `C`,
        or `C[b]` where an entry names boundary b, the link between stages b and b + 1.
        The boundary is `deps.boundary`'s; the frozen part's output (-1, stage 0's input)
        crosses no stage boundary and takes `C`."""
        return self.of("C", deps.boundary(op.kind, op.stage or 0))

    def link(self) -> Callable[[Action, int, int], float] | None:
        """`transfer` as the timing engine's link (`sim.engine.Link`) where some `C` entry
        names a stage boundary; None when one `C` times every transfer."""
        if not any(kind == "C" and stage is not None for kind, stage, _ in self.entries):
            return None
        return lambda op, src, dst: self.transfer(op)

    def whole_backward(self) -> CostModel:
        """This model for a schedule that does not split W off its backward: its `B`
        takes B + W (the zero-bubble paper's convention), so that one cost spec describes
        one model and every schedule's makespan compares. W is 0 unless given, so a spec
        without W means the same for every schedule."""
        if not any(kind == "W" and value for kind, _, value in self.entries):
            return self
        stages = [None, *sorted(self.stages())]
        whole = tuple(("B", s, self.of("B", s) + self.of("W", s)) for s in stages)
        return CostModel((*self.entries, *whole))

    def for_kinds(self, kinds: Iterable[Kind]) -> CostModel:
        """The model a schedule with these op kinds is timed by: `whole_backward` unless
        it splits W off its backward."""
        return self if Kind.W in kinds else self.whole_backward()

    def stages(self) -> set[int]:
        """The stages that per-stage entries name."""
        return {stage for _, stage, _ in self.entries if stage is not None}

    def gives(self, kind: str) -> bool:
        """Whether any entry sets `kind` (`FB` has no default)."""
        return any(name == kind for name, _, _ in self.entries)

    def merged(self, other: CostModel | None) -> CostModel:
        """This model with `other`'s entries taking precedence."""
        return self if other is None else CostModel(self.entries + other.entries)
