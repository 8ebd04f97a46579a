"""The AST of a `.pipe` file: frozen dataclasses, every node with the `Span` it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelang.source import SourceFile, Span


@dataclass(frozen=True, slots=True)
class Node:
    """Base of every AST node; `span` is where its text is."""

    span: Span = field(compare=False, repr=False)


# ---- expressions -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntLit(Node):
    """An integer literal: `8`."""

    value: int


@dataclass(frozen=True, slots=True)
class BoolLit(Node):
    """`true` or `false`."""

    value: bool


@dataclass(frozen=True, slots=True)
class Name(Node):
    """A reference to a parameter, `let`, loop variable or the rank variable."""

    id: str


@dataclass(frozen=True, slots=True)
class Unary(Node):
    """`-x` or `not x`."""

    op: str
    operand: Expr


@dataclass(frozen=True, slots=True)
class Binary(Node):
    """`a OP b` for arithmetic (`+ - * // %`), comparison, `and`, `or`."""

    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Call(Node):
    """`min(a, b)`, `max(...)`, or a user `fn`."""

    func: str
    args: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Conditional(Node):
    """`if c then a else b`."""

    test: Expr
    then: Expr
    otherwise: Expr


Expr = IntLit | BoolLit | Name | Unary | Binary | Call | Conditional


@dataclass(frozen=True, slots=True)
class Range(Node):
    """`a..b`: the integers a, a+1, ..., b-1."""

    start: Expr
    stop: Expr


# ---- statements inside an order ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Let(Node):
    """`let name = expr`."""

    name: str
    value: Expr


@dataclass(frozen=True, slots=True)
class OpCall(Node):
    """`F(mb)`, `B(mb, stage)`, `W(mb=i, stage=s)`, or `F(stage=s) @ slot` in a repeat.

    `kind` is `F`, `B`, `W`, `R`, `BW`: a full backward in a split schedule (its B
    and W as one action), or `U`: a weight update (`U()`, `U(stage=s)`), which has no
    micro-batch."""

    kind: str
    mb: Expr | None
    stage: Expr | None
    slot: Expr | None
    chunk: Expr | None = None
    """`chunk=c`: which sequence chunk of the micro-batch, in a schedule with `chunks`."""


@dataclass(frozen=True, slots=True)
class For(Node):
    """`for i in a..b { ... }`."""

    var: str
    range: Range
    body: tuple[Stmt, ...]


@dataclass(frozen=True, slots=True)
class If(Node):
    """`if cond { ... } else { ... }`."""

    test: Expr
    then: tuple[Stmt, ...]
    otherwise: tuple[Stmt, ...]


@dataclass(frozen=True, slots=True)
class Pair(Node):
    """`F(i, a) & B(j, b)`: two ops that start together as one step (an overlapped pair)."""

    first: OpCall
    second: OpCall


@dataclass(frozen=True, slots=True)
class Evict(Node):
    """`E(i) -> rank p`: evict the activations `F(i)` kept to rank `p` until `L(i)`."""

    op: OpCall
    partner: Expr


Stmt = Let | OpCall | Pair | Evict | For | If


# ---- schedule-level declarations -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param(Node):
    """`name: int = default`; no default means the user must give it."""

    name: str
    type: str
    default: Expr | None


@dataclass(frozen=True, slots=True)
class Require(Node):
    """`require cond : "message"`: the parameters must make `cond` true."""

    test: Expr
    message: str


@dataclass(frozen=True, slots=True)
class Ops(Node):
    """`ops F, B, W`: the compute kinds every (micro-batch, stage) runs."""

    kinds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CostItem(Node):
    """`B = 2` or `F[3] = 1.5` inside a `cost` line."""

    kind: str
    stage: Expr | None
    value: float


@dataclass(frozen=True, slots=True)
class Cost(Node):
    """`cost F = 1, B = 2`: the schedule's default cost model."""

    items: tuple[CostItem, ...]


@dataclass(frozen=True, slots=True)
class PipelineDecl(Node):
    """`pipeline down: stage s in 0..D -> rank s`, or a family `pipeline p[j in 0..f]: ...`."""

    name: str
    index_var: str | None
    index_range: Range | None
    stage_var: str
    stages: Range
    rank: Expr


@dataclass(frozen=True, slots=True)
class PipeRef(Node):
    """`down` or `down[j]`."""

    name: str
    index: Expr | None


@dataclass(frozen=True, slots=True)
class Assign(Node):
    """`0..N/2 -> down` or `m in 0..N -> down[m % f]`."""

    var: str | None
    range: Range
    pipeline: PipeRef


@dataclass(frozen=True, slots=True)
class Microbatches(Node):
    """`microbatches A, B, ...`: which pipeline each micro-batch goes through."""

    items: tuple[Assign, ...]


@dataclass(frozen=True, slots=True)
class Partition(Node):
    """`partition 3, 5, 4, 4`: how many of the model's layers each stage holds."""

    counts: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class After(Node):
    """`later after earlier [for i in a..b]`: an extra dependency."""

    later: OpCall
    earlier: OpCall
    var: str | None
    range: Range | None


@dataclass(frozen=True, slots=True)
class Weights(Node):
    """`weights stash`, `weights latest` or `weights K`: the schedule is asynchronous, and
    this is how each stage copy versions its weights between its `U` updates."""

    policy: str
    """`stash` (a backward reads its forward's version), `latest` (no stash) or
    `buffers` (stash, at most `count` versions)."""
    count: Expr | None


@dataclass(frozen=True, slots=True)
class Frozen(Node):
    """`frozen on rank EXPR` or `frozen on ranks A..B`: ranks that hold the model's frozen
    (non-trainable) part and may run its forward `P(mb)`."""

    ranks: Range


@dataclass(frozen=True, slots=True)
class ChunksDecl(Node):
    """`chunks C` or `chunks C equal compute`: every micro-batch is split into C sequence
    chunks of equal tokens (the default) or equal compute; `... if EXPR` splits that way
    only when the condition holds (equal tokens otherwise)."""

    count: Expr
    split: str
    when: Expr | None = None


@dataclass(frozen=True, slots=True)
class ShapeList(Node):
    """`lengths L0, L1, ...` or `sizes S0, S1, ...`: one value per micro-batch, its
    sequence length in tokens or its number of samples."""

    what: str
    values: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class OrderRank(Node):
    """`order rank r { ... }`: each rank's order written out with loops."""

    var: str
    body: tuple[Stmt, ...]


@dataclass(frozen=True, slots=True)
class OrderGreedy(Node):
    """`order greedy { prefer ..  priority ..  cap ..  frozen .. }`: list scheduling by
    a rule."""

    prefer: tuple[str, ...]
    priority: tuple[Expr, ...]
    cap: Expr | None
    frozen: str = "best"
    """How frozen forwards run: `fill` bubbles, `first`, or the `best` of the two."""


@dataclass(frozen=True, slots=True)
class OrderRepeat(Node):
    """`order repeat k every T { ... }`: one micro-batch's ops at slots, repeated;
    `squeeze` after `every T` moves warm-up and cool-down ops earlier (orders/squeeze.py)."""

    var: str
    every: Expr | None
    body: tuple[Stmt, ...]
    squeeze: bool = False


Order = OrderRank | OrderGreedy | OrderRepeat
Decl = (
    Require
    | Let
    | Ops
    | Cost
    | PipelineDecl
    | Microbatches
    | After
    | Partition
    | Weights
    | Frozen
    | ChunksDecl
    | ShapeList
    | Order
)


@dataclass(frozen=True, slots=True)
class Schedule(Node):
    """`schedule name(params) { declarations }`."""

    name: str
    params: tuple[Param, ...]
    body: tuple[Decl, ...]


@dataclass(frozen=True, slots=True)
class FnDecl(Node):
    """`fn name(a, b) = expr`: a pure integer function, importable."""

    name: str
    params: tuple[str, ...]
    body: Expr


@dataclass(frozen=True, slots=True)
class Import(Node):
    """`import "path.pipe"`: brings in the `fn`s of another file."""

    path: str


@dataclass(frozen=True)
class File:
    """A parsed file with its imports resolved: the schedule and every visible `fn`."""

    source: SourceFile
    schedule: Schedule
    fns: dict[str, FnDecl]


def dump(node: object, indent: int = 0) -> str:
    """An indented text form of an AST, one node per line, for `--dump-after parse`."""
    pad = "  " * indent
    if isinstance(node, tuple):
        return "\n".join(dump(child, indent) for child in node) if node else f"{pad}()"
    if not isinstance(node, Node):
        return f"{pad}{node!r}"
    fields = [f for f in node.__dataclass_fields__ if f != "span"]
    simple = [f for f in fields if not isinstance(getattr(node, f), Node | tuple)]
    nested = [f for f in fields if f not in simple]
    head = " ".join(f"{f}={getattr(node, f)!r}" for f in simple)
    lines = [f"{pad}{type(node).__name__} @{node.span.line}:{node.span.column} {head}".rstrip()]
    for f in nested:
        value = getattr(node, f)
        if value == ():
            continue
        lines.append(f"{pad}  .{f}")
        lines.append(dump(value, indent + 2))
    return "\n".join(lines)
