"""The IR: a `Program` is, for every rank, the ordered list of `Action`s it runs.

One action type serves every stage of the compiler. Each action has a one-token text
form that `Action.parse` reads back; IR dumps, golden files and error grids use it:

    F3@1/down               forward of micro-batch 3 on stage 1 of pipeline `down`
    &B0@3/down              B0@3/down, started together with the action before it
                            (an overlapped pair `F(3, 1) & B(0, 3)`, or a full backward)
    send:F3@1/down>2        send what F3@1/down produced to rank 2
    recv:F3@1/down<1        receive what F3@1/down produced from rank 1
    signal:F2@1/down>0      tell rank 0 that F2@1/down finished (an `after` dependency)
    wait:F2@1/down<1        wait until rank 1 says F2@1/down finished
    allreduce@1/down        sum stage 1's gradients over every replica of stage 1
    step                    run the optimizer on every stage copy this rank holds
    E3@0/main>3             evict the activations F3@0/main kept to rank 3 (BPipe)
    H3@0/main               on the partner: hold what E3@0/main evicts until it is loaded
    L3@0/main               load those activations back (before B3@0/main needs them)
    F3.1@0/main             forward of chunk 1 of micro-batch 3 on stage 0, in a schedule
                            that splits micro-batches into sequence chunks (`chunks C`)
    P3@0/main               the frozen (non-trainable) part's forward of micro-batch 3,
                            whose output is the input of F3@0/main (DiffusionPipe)
    U2@1/main               the third weight update (number 2) of stage 1 of pipeline
                            `main`: it makes version 3 (asynchronous schedules only)
"""

from __future__ import annotations

import enum
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from pipelang.diagnostics import InternalError
from pipelang.source import Span


class Kind(enum.Enum):
    """What an action does."""

    F = "F"
    """Forward of one micro-batch through one stage. Roughly: `y = stage(x); save(x, y)`."""
    B = "B"
    """Backward: input gradient (and weight gradient too unless `W` is split off).
    Roughly: `dx = grad(y, x, dy)`."""
    W = "W"
    """Weight gradient alone, split off `B` (zero-bubble). Roughly: `dw += grad(y, w, dy)`."""
    R = "R"
    """Recompute a forward whose activations were dropped. Roughly: `y = stage(x)` again."""
    P = "P"
    """Frozen forward: the model's non-trainable part (a frozen encoder) on one
    micro-batch, without gradients; its output is the input of F(mb, 0), so the action
    names stage 0 of the micro-batch's pipeline: `P3@0/main`. It runs on any rank that
    holds the frozen part (`Program.frozen`). Roughly: `x0 = frozen(ids)`."""
    SEND = "send"
    """Send the output of a compute op to the rank that consumes it (non-blocking)."""
    RECV = "recv"
    """Receive the output of a compute op from the rank that produced it (blocking)."""
    SIGNAL = "signal"
    """Tell another rank a compute op finished; carries no data (an `after` dependency)."""
    WAIT = "wait"
    """Block until another rank signals that a compute op finished."""
    ALLREDUCE = "allreduce"
    """Sum one stage's gradients over all its replicas (Chimera's two directions)."""
    STEP = "step"
    """Optimizer step on every stage copy the rank holds; ends the iteration."""
    U = "U"
    """Weight update of one stage copy in an asynchronous schedule: the optimizer applies
    the gradients accumulated since the copy's previous update and makes a new version
    of its weights. Its `mb` field numbers the copy's updates 0, 1, ...; update k makes
    version k + 1 (version 0 is the initial weights)."""
    E = "E"
    """Evict: move the activations F(mb, stage) kept off this rank to the partner rank
    `peer` (BPipe), freeing them here until their `L`. Written `E3@0/main>3`."""
    L = "L"
    """Load: take the activations an `E` evicted back from the partner, before the ops
    of that (micro-batch, stage) that need them (`R`, `B`)."""
    H = "H"
    """Hold, on the partner: receive activations another rank evicts and keep them until
    that rank loads them back. Inserted by the compiler (`insert-holds`), never written."""

    # Members are singletons compared by identity, so hash them by identity too, in C:
    # Enum's own __hash__ is a Python call, and every Action hash goes through it.
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.R, Kind.P})
COMM_KINDS = frozenset({Kind.SEND, Kind.RECV, Kind.SIGNAL, Kind.WAIT})
STASH_KINDS = frozenset({Kind.E, Kind.L, Kind.H})
"""Evicting activations to a partner rank and loading them back (BPipe). These are ops
of the dependency graph like the compute kinds, but no (micro-batch, stage) must run
them and they take no compute time."""
_TOKENS = {kind: kind.value for kind in Kind}
_ARROWS = {Kind.SEND: ">", Kind.SIGNAL: ">"}
GRAPH_KINDS = COMPUTE_KINDS | STASH_KINDS
"""The kinds of the actions that are nodes of the dependency graph (`build-dag`)."""


class Action(NamedTuple):
    """One thing a rank does.

    Compute actions use `kind`, `mb`, `stage`, `pipeline`, and `chunk` in a schedule
    that splits micro-batches into sequence chunks (None otherwise). Communication
    actions name the compute op whose result they move (`of`) and the other rank
    (`peer`). `allreduce` names a stage and pipeline; `step` names nothing; `U` uses `mb`
    for its number.
    `span` is where the action came from; it takes no part in equality or hashing.

    `fused` marks a compute action that starts together with the one before it on its
    rank, as one step: `F(i, a) & B(j, b)` (an overlapped pair, torch's OVERLAP_F_B) or a
    full backward `BW(j, b)` in a split schedule (its B, then its W fused to it). A run of
    actions joined this way is a *compound*: it starts when the inputs of all its ops are
    ready and all of them end together. Every pass that needs no timing treats them as
    ops in order. Like `span`, `fused` takes no part in equality or hashing.

    Immutable like every IR node, but a NamedTuple rather than a frozen dataclass: a
    large schedule makes 4 x 10^5 actions per compile, and a tuple is built several
    times faster (see "Compile speed" in benchmarks/RESULTS.md).
    """

    kind: Kind
    mb: int | None = None
    stage: int | None = None
    pipeline: str | None = None
    peer: int | None = None
    of: Kind | None = None
    chunk: int | None = None
    span: Span | None = None
    fused: bool = False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return self[:7] == other[:7]

    def __ne__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return self[:7] != other[:7]

    def __hash__(self) -> int:
        return hash(self[:7])

    def __repr__(self) -> str:
        return f"Action({self.text()})"

    def op(self) -> Action:
        """The compute op this action is about (itself for compute and stash actions)."""
        if self.kind.is_compute or self.kind in STASH_KINDS:
            return self
        if self.of is None:
            raise InternalError(f"{self} names no compute op")
        return Action(self.of, self.mb, self.stage, self.pipeline, chunk=self.chunk, span=self.span)

    def unit(self) -> str:
        """The micro-batch, with its chunk if it names one: `3`, or `3.1` for chunk 1."""
        return str(self.mb) if self.chunk is None else f"{self.mb}.{self.chunk}"

    def unfused(self) -> Action:
        """This action without the `fused` mark."""
        return self._replace(fused=False) if self.fused else self

    def text(self) -> str:
        """The one-token text form; `Action.parse(a.text()) == a`."""
        kind = self.kind
        mb = self.unit()
        if kind in COMPUTE_KINDS:  # the common case, without Enum's `.value` descriptor
            fused = "&" if self.fused else ""
            return f"{fused}{_TOKENS[kind]}{mb}@{self.stage}/{self.pipeline}"
        if kind is Kind.STEP:
            return "step"
        if kind in STASH_KINDS:
            to = "" if self.peer is None else f">{self.peer}"
            return f"{kind.value}{mb}@{self.stage}/{self.pipeline}{to}"
        if kind is Kind.U:
            return f"U{self.mb}@{self.stage}/{self.pipeline}"
        if kind is Kind.ALLREDUCE:
            return f"allreduce@{self.stage}/{self.pipeline}"
        assert self.of is not None
        return (
            f"{_TOKENS[kind]}:{_TOKENS[self.of]}{mb}@{self.stage}/{self.pipeline}"
            f"{_ARROWS.get(kind, '<')}{self.peer}"
        )

    def __str__(self) -> str:
        return self.text()

    @staticmethod
    def parse(token: str, span: Span | None = None) -> Action:
        """Read the one-token text form back; raises ValueError on anything else."""
        match = _TOKEN.fullmatch(token.strip())
        if match is None:
            raise ValueError(f"not an action: {token!r}")
        g = match.groupdict()
        if g["step"]:
            return Action(Kind.STEP, span=span)
        if g["ar_stage"] is not None:
            return Action(Kind.ALLREDUCE, None, int(g["ar_stage"]), g["ar_pipe"], span=span)
        if g["u_mb"] is not None:
            return Action(Kind.U, int(g["u_mb"]), int(g["u_stage"]), g["u_pipe"], span=span)
        op_kind, mb, stage, pipe = Kind(g["op"]), int(g["mb"]), int(g["stage"]), g["pipe"]
        chunk = None if g["chunk"] is None else int(g["chunk"])
        if g["comm"] is None and op_kind in STASH_KINDS:
            if chunk is not None:
                raise ValueError(f"evictions do not name a chunk: {token!r}")
            return _stash_action(token, op_kind, mb, stage, pipe, g, span)
        if g["comm"] is None:
            return Action(op_kind, mb, stage, pipe, chunk=chunk, span=span, fused=bool(g["fused"]))
        if g["fused"]:
            raise ValueError(f"only a compute action can be fused (`&`): {token!r}")
        comm = Kind(g["comm"])
        wants = ">" if comm in (Kind.SEND, Kind.SIGNAL) else "<"
        if g["arrow"] != wants:
            raise ValueError(f"`{comm.value}` takes `{wants}`, not `{g['arrow']}`: {token!r}")
        return Action(comm, mb, stage, pipe, int(g["peer"]), op_kind, chunk, span=span)


def _stash_action(
    token: str, kind: Kind, mb: int, stage: int, pipe: str, g: dict[str, str], span: Span | None
) -> Action:
    """`E3@0/main>3` (an eviction names its partner), `L3@0/main`, `H3@0/main`."""
    if g["fused"]:
        raise ValueError(f"only a compute action can be fused (`&`): {token!r}")
    if g["arrow"] is None:
        return Action(kind, mb, stage, pipe, span=span)
    if kind is not Kind.E or g["arrow"] != ">":
        raise ValueError(f"only an eviction names a partner, as `E3@0/main>3`: {token!r}")
    return Action(kind, mb, stage, pipe, int(g["peer"]), span=span)


_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_TOKEN = re.compile(
    rf"(?P<step>step)"
    rf"|allreduce@(?P<ar_stage>\d+)/(?P<ar_pipe>{_NAME})"
    rf"|U(?P<u_mb>\d+)@(?P<u_stage>\d+)/(?P<u_pipe>{_NAME})"
    rf"|(?P<fused>&)?(?:(?P<comm>send|recv|signal|wait):)?(?P<op>[FBWRPEHL])(?P<mb>\d+)(?:\.(?P<chunk>\d+))?@(?P<stage>\d+)/(?P<pipe>{_NAME})"
    rf"(?:(?P<arrow>[<>])(?P<peer>\d+))?"
)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A named placement of every stage on a rank; two or more pipelines are replicas."""

    name: str
    placement: tuple[int, ...]
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)


_COPIES: OrderedDict[int, tuple[tuple[Pipeline, ...], dict[int, tuple[tuple[int, str], ...]]]]
_COPIES = OrderedDict()
"""The last few `_copies_by_rank` answers, by the identity of the pipelines they index."""


def _copies_by_rank(
    pipelines: tuple[Pipeline, ...],
) -> dict[int, tuple[tuple[int, str], ...]]:
    """Every rank's (stage, pipeline) copies, in pipeline then stage order: built once
    per Program's pipelines (by identity: hashing a placement of 100,000 ranks at every
    call would cost as much as the scan it saves), so that asking for each rank's copies
    is linear in the ranks, not quadratic."""
    cached = _COPIES.get(id(pipelines))
    if cached is not None and cached[0] is pipelines:
        _COPIES.move_to_end(id(pipelines))
        return cached[1]
    copies: dict[int, list[tuple[int, str]]] = {}
    for p in pipelines:
        for stage, rank in enumerate(p.placement):
            copies.setdefault(rank, []).append((stage, p.name))
    index = {rank: tuple(c) for rank, c in copies.items()}
    _COPIES[id(pipelines)] = (pipelines, index)  # holds `pipelines`: its id stays unique
    if len(_COPIES) > 64:
        _COPIES.popitem(last=False)
    return index


@dataclass(frozen=True, slots=True)
class WeightPolicy:
    """How an asynchronous schedule versions each stage copy's weights (`weights ...`).

    Every forward reads the copy's newest version where it runs in its rank's order;
    `U` makes a new one. What a backward (and `W`, `R`) reads is the policy:

    - `stash`: the version its forward read (PipeDream's weight stashing), so a copy
      keeps every version a micro-batch in flight still needs;
    - `buffers` with `limit` K: the same, but at most K versions may be live at once
      (PipeDream-2BW: K = 2); more is E0314;
    - `latest`: the newest version, with no stash (PipeMare): one version.
    """

    mode: str
    limit: int | None = None
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def stashes(self) -> bool:
        """Whether a backward reads the version its forward read."""
        return self.mode != "latest"

    def text(self) -> str:
        """The declaration's argument: `stash`, `latest` or the number of buffers."""
        return str(self.limit) if self.mode == "buffers" else self.mode

    @staticmethod
    def parse(text: str) -> WeightPolicy:
        """Read `text()` back; raises ValueError on anything else."""
        if text in ("stash", "latest"):
            return WeightPolicy(text)
        if text.isdigit() and int(text) >= 1:
            return WeightPolicy("buffers", int(text))
        raise ValueError(f"not a weight policy: {text!r}")


@dataclass(frozen=True, slots=True)
class Dependency:
    """An extra `after` edge: `later` may not start before `earlier` ends."""

    earlier: Action
    later: Action
    span: Span | None = field(default=None, compare=False, hash=False, repr=False)


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

MAX_TIME = 1e15
"""The largest time a cost model takes: sums over 10^6 ops stay finite (and JSON)."""


COST_KINDS = ("F", "B", "W", "R", "P", "C", "FB", "E", "L", "A", "S", "O", "KV")
"""Every cost entry's name: the times of op kinds, a transfer (`C`), an overlapped pair
(`FB`), an eviction's trips (`E`, `L`), and the shares and sizes `A`, `S`, `O`, `KV`
(the grammar's `COSTNAME` spells the same list)."""


def cost_problem(kind: str, value: float) -> str | None:
    """What is wrong with cost entry `kind = value`, None when nothing: the one rule for
    `cost` lines, `--cost` and the API's costs. A time is 0 to 10^15; `A`, `O` and `KV`
    are shares, 0 to 1; `S` is tokens, 0 (the longest micro-batch) or at least 1."""
    if not 0 <= value <= MAX_TIME:  # NaN fails too
        return f"`{kind}` is {value:g}; a time is between 0 and 10^15"
    if kind in ("A", "O") and value > 1:
        return f"`{kind}` is a share of an op's work, between 0 and 1, not {value:g}"
    if kind == "KV" and value > 1:
        return f"`KV` is a share of a stage's activations, between 0 and 1, not {value:g}"
    if kind == "S" and 0 < value < 1:
        return f"`S` is the reference's tokens, 0 (the longest) or at least 1, not {value:g}"
    return None


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time of each op kind (`F`, `B`, `W`, `R`, `P`), of one transfer (`C`), and of an
    overlapped forward-backward pair (`FB`, for the forward's stage; without it a pair
    takes the sum of its ops). `A` is no time but a share: how much of an op's work on
    a whole micro-batch is attention, which splits it over sequence chunks (`Chunks`)
    and scales it with micro-batch shapes (`BatchShapes`); `S` is no time either: the
    tokens of the reference micro-batch the times are for, with shapes (0: the longest),
    and `O` the share of the reference's time that a smaller micro-batch still takes.
    `KV` is memory, not time: the share of a stage's activations that are attention keys
    and values, which a sequence chunk's forward past the first saves again, concatenated
    with the chunks' before it (`KV_SHARE` by default, `memory.shares`).

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
        compound's time, `FB` or the sum of its ops, is the simulator's.)"""
        kind = op.kind
        return 0.0 if kind in STASH_KINDS else self.of(kind.value, op.stage)

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


@dataclass(frozen=True, slots=True)
class Program:
    """A whole schedule after expansion: per-rank ordered actions plus what they mean.

    `placement` of each pipeline maps stage -> rank; `assignment[mb]` names the pipeline
    micro-batch `mb` travels through; `kinds` are the compute kinds every (micro-batch,
    stage) must run exactly once.
    """

    name: str
    source: str
    params: tuple[tuple[str, int | bool], ...]
    num_ranks: int
    num_stages: int
    pipelines: tuple[Pipeline, ...]
    assignment: tuple[str, ...]
    kinds: tuple[Kind, ...]
    ranks: tuple[tuple[Action, ...], ...]
    after: tuple[Dependency, ...] = ()
    costs: CostModel = CostModel()
    order_span: Span | None = field(default=None, compare=False, repr=False)
    """Where the schedule's `order` is written; diagnostics about missing ops point here."""
    partition: tuple[int, ...] | None = None
    """Layers per stage from the schedule's `partition` line, for the runtime; None: even."""
    weights: WeightPolicy | None = None
    """The weight versioning of an asynchronous schedule (its ranks update their stage
    copies with `U` actions, and there is no `step`); None for a synchronous one."""
    frozen: tuple[int, ...] | None = None
    """The ranks that hold the model's frozen part (`frozen on ...`), ascending; None when
    the schedule has none. Each micro-batch's `P` runs on one of them."""
    chunks: Chunks | None = None
    """How micro-batches split into sequence chunks (`chunks C`); None: they do not, and
    compute actions name no chunk."""
    shapes: BatchShapes | None = None
    """Each micro-batch's samples and sequence length when they differ (`lengths`,
    `sizes`, `--lengths FILE`); None: every micro-batch has the runtime's one shape."""

    @property
    def num_microbatches(self) -> int:
        return len(self.assignment)

    def pipeline(self, name: str) -> Pipeline:
        for p in self.pipelines:
            if p.name == name:
                return p
        raise InternalError(f"no pipeline named {name!r}")

    def rank_of(self, stage: int, pipeline: str) -> int:
        """The rank that runs `stage` of `pipeline`."""
        return self.pipeline(pipeline).placement[stage]

    def replicas(self, stage: int) -> tuple[int, ...]:
        """Ranks holding a copy of `stage`, one entry per pipeline, in pipeline order."""
        return tuple(p.placement[stage] for p in self.pipelines)

    def stage_copies(self, rank: int) -> tuple[tuple[int, str], ...]:
        """(stage, pipeline) copies of the weights that `rank` holds."""
        return _copies_by_rank(self.pipelines).get(rank, ())

    def first_eviction(self) -> Action | None:
        """The first evict, hold or load action (BPipe), in rank order; None if none."""
        return next((a for acts in self.ranks for a in acts if a.kind in STASH_KINDS), None)

    def compute_ops(self) -> Iterator[Action]:
        """Every op the schedule must run, in (micro-batch, stage, kind) order (a
        micro-batch's `P` first)."""
        frozen = self.frozen is not None
        chunks = (None,) if self.chunks is None else tuple(range(self.chunks.count))
        for mb, pipe in enumerate(self.assignment):
            if frozen:
                yield Action(Kind.P, mb, 0, pipe)
            for stage in range(self.num_stages):
                for chunk in chunks:
                    for kind in self.kinds:
                        yield Action(kind, mb, stage, pipe, chunk=chunk)

    def inputs_of(self, op: Action) -> tuple[Action, ...]:
        """The compute ops whose results `op` consumes (its data dependencies).

        F(m, s) needs F(m, s-1), and F(m, 0) needs P(m, 0) when there is a frozen part;
        P needs nothing; B(m, s) needs B(m, s+1) (the loss on the last stage) and
        F(m, s), and R(m, s) when recompute is on; W(m, s) needs B(m, s); R(m, s) needs
        F(m, s). With sequence chunks, each of these is about the same chunk, and on
        its stage F(m, c) also needs F(m, c-1) (the keys and values of the tokens before
        it) and B(m, c) needs B(m, c+1) (which hands back their gradients).
        """
        mb, stage, pipe, chunk = op.mb, op.stage, op.pipeline, op.chunk
        assert stage is not None
        deps: list[Action] = []
        if op.kind is Kind.F:
            if stage > 0:
                deps.append(Action(Kind.F, mb, stage - 1, pipe, chunk=chunk))
            elif self.frozen is not None:
                deps.append(Action(Kind.P, mb, 0, pipe))
            if chunk:
                deps.append(Action(Kind.F, mb, stage, pipe, chunk=chunk - 1))
        elif op.kind is Kind.P:
            pass
        elif op.kind is Kind.B:
            deps.append(Action(Kind.F, mb, stage, pipe, chunk=chunk))
            if Kind.R in self.kinds:
                deps.append(Action(Kind.R, mb, stage, pipe, chunk=chunk))
            if stage + 1 < self.num_stages:
                deps.append(Action(Kind.B, mb, stage + 1, pipe, chunk=chunk))
            if chunk is not None and self.chunks is not None and chunk + 1 < self.chunks.count:
                deps.append(Action(Kind.B, mb, stage, pipe, chunk=chunk + 1))
        elif op.kind is Kind.W:
            deps.append(Action(Kind.B, mb, stage, pipe, chunk=chunk))
        elif op.kind is Kind.R:
            deps.append(Action(Kind.F, mb, stage, pipe, chunk=chunk))
        else:
            raise InternalError(f"{op} is not a compute op")
        return tuple(deps)

    def dump(self) -> str:
        """The text dump: one line per rank, actions as tokens (`Action.parse` reads each
        token back)."""
        width = len(str(self.num_ranks - 1))
        return "\n".join(
            f"rank {r:>{width}}: " + " ".join(a.text() for a in actions)
            for r, actions in enumerate(self.ranks)
        )

    def to_json(self) -> str:
        """The whole Program (comms included) as JSON, for the backends."""
        doc = {
            "format": "pipelang-program/1",
            "name": self.name,
            "source": self.source,
            "params": dict(self.params),
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "pipelines": [{"name": p.name, "placement": list(p.placement)} for p in self.pipelines],
            "assignment": list(self.assignment),
            "kinds": [k.value for k in self.kinds],
            "after": [[d.earlier.text(), d.later.text()] for d in self.after],
        }
        if self.partition is not None:
            doc["partition"] = list(self.partition)
        if self.weights is not None:
            doc["weights"] = self.weights.text()
        if self.frozen is not None:
            doc["frozen"] = list(self.frozen)
        if self.shapes is not None:
            doc["shapes"] = {
                "samples": list(self.shapes.samples),
                "lengths": list(self.shapes.lengths),
                "reference": self.shapes.reference(self.costs),
                "attention": self.costs.of("A"),
            }
        if self.chunks is not None:
            doc["chunks"] = {
                "count": self.chunks.count,
                "split": self.chunks.split,
                "attention": self.costs.of("A"),
            }
        # The ranks last, one a line, by json's C encoder (an indented dump is the
        # pure-Python one: seconds at 10^5 actions).
        ranks = ",\n  ".join(json.dumps([a.text() for a in actions]) for actions in self.ranks)
        return json.dumps(doc, indent=1)[:-2] + f',\n "ranks": [\n  {ranks}\n ]\n}}'

    @staticmethod
    def from_json(text: str) -> Program:
        """Read `to_json` back (source spans are not kept)."""
        doc = json.loads(text)
        if doc.get("format") != "pipelang-program/1":
            raise ValueError("not a pipelang program (missing format pipelang-program/1)")
        chunks, shapes = doc.get("chunks"), doc.get("shapes")
        costs: list[tuple[str, int | None, float]] = []
        for part in (chunks, shapes):
            if part is not None:
                costs.append(("A", None, float(part["attention"])))
        if shapes is not None:
            costs.append(("S", None, float(shapes["reference"])))
        return Program(
            name=doc["name"],
            source=doc["source"],
            params=tuple(doc["params"].items()),
            num_ranks=doc["num_ranks"],
            num_stages=doc["num_stages"],
            pipelines=tuple(Pipeline(p["name"], tuple(p["placement"])) for p in doc["pipelines"]),
            assignment=tuple(doc["assignment"]),
            kinds=tuple(Kind(k) for k in doc["kinds"]),
            ranks=tuple(tuple(Action.parse(t) for t in actions) for actions in doc["ranks"]),
            after=tuple(Dependency(Action.parse(a), Action.parse(b)) for a, b in doc["after"]),
            partition=tuple(doc["partition"]) if doc.get("partition") is not None else None,
            weights=WeightPolicy.parse(doc["weights"]) if "weights" in doc else None,
            frozen=tuple(doc["frozen"]) if doc.get("frozen") is not None else None,
            costs=CostModel().merged(CostModel(tuple(costs))),
            chunks=None if chunks is None else Chunks(chunks["count"], chunks["split"]),
            shapes=None
            if shapes is None
            else BatchShapes(tuple(shapes["samples"]), tuple(shapes["lengths"])),
        )
