"""The lark parse tree of a `.pipe` file into `pipelang.ast`: one method per grammar rule
(lark calls each by the rule's name), each node carrying the span of its text. The
parser (`pipelang/parser.py`) runs it and turns what it raises into diagnostics."""

from __future__ import annotations

from typing import Any

from lark import Token, Transformer
from lark.tree import Meta

from pipelang import ast
from pipelang.diagnostics import fail
from pipelang.evaluate import MAX_DIGITS
from pipelang.ir import cost_name_problem, cost_problem
from pipelang.source import SourceFile, Span


class AstBuilder(Transformer[Token, Any]):
    """lark tree -> `pipelang.ast`, attaching a Span to every node."""

    def __init__(self, source: SourceFile) -> None:
        super().__init__(visit_tokens=False)
        self.source = source

    def _span(self, meta: Meta) -> Span:
        if getattr(meta, "empty", True):
            return Span(self.source, 0, 0)
        return Span(self.source, meta.start_pos, meta.end_pos)

    def _tok(self, token: Token) -> Span:
        return Span(self.source, token.start_pos or 0, token.end_pos or 0)

    def __default__(self, data: str, children: list[Any], meta: Meta) -> Any:
        handler = getattr(self, f"_{data}", None)
        if handler is None:
            return children
        return handler(self._span(meta), *children)

    # top level
    def _start(self, span: Span, *items: Any) -> list[Any]:
        return list(items)

    def _import_decl(self, span: Span, path: Token) -> ast.Import:
        return ast.Import(span, str(path)[1:-1])

    def _fn_decl(self, span: Span, name: Token, *rest: Any) -> ast.FnDecl:
        *params, body = rest
        names = tuple(str(p) for p in params if p is not None)
        if len(set(names)) != len(names):
            raise fail("E0102", f"`fn {name}` names a parameter twice", span)
        return ast.FnDecl(span, str(name), names, body)

    def _schedule(self, span: Span, name: Token, *rest: Any) -> ast.Schedule:
        params = tuple(r for r in rest if isinstance(r, ast.Param))
        body = tuple(r for r in rest if r is not None and not isinstance(r, ast.Param))
        return ast.Schedule(span, str(name), params, body)

    def _param(self, span: Span, name: Token, type_: Token, default: Any) -> ast.Param:
        return ast.Param(span, str(name), str(type_), default)

    # declarations
    def _require(self, span: Span, test: ast.Expr, message: Token) -> ast.Require:
        return ast.Require(span, test, str(message)[1:-1])

    def _let(self, span: Span, name: Token, value: ast.Expr) -> ast.Let:
        return ast.Let(span, str(name), value)

    def _ops_decl(self, span: Span, *kinds: Token) -> ast.Ops:
        return ast.Ops(span, tuple(str(k) for k in kinds))

    def _cost_decl(self, span: Span, *items: ast.CostItem) -> ast.Cost:
        return ast.Cost(span, items)

    def _cost_item(self, span: Span, kind: Token, stage: Any, value: Token) -> ast.CostItem:
        problem = cost_name_problem(str(kind))
        if problem is not None:
            raise fail("E0209", problem, self._tok(kind))
        problem = cost_problem(str(kind), float(value))
        if problem is not None:
            raise fail("E0209", f"cost {problem}", self._tok(value))
        return ast.CostItem(span, str(kind), stage, float(value))

    def _pipeline_decl(
        self, span: Span, name: Token, index: Any, var: Token, stages: ast.Range, rank: ast.Expr
    ) -> ast.PipelineDecl:
        index_var, index_range = index if index is not None else (None, None)
        return ast.PipelineDecl(span, str(name), index_var, index_range, str(var), stages, rank)

    def _index(self, span: Span, var: Token, rng: ast.Range) -> tuple[str, ast.Range]:
        return str(var), rng

    def _partition_decl(self, span: Span, *counts: ast.Expr) -> ast.Partition:
        return ast.Partition(span, counts)

    def _microbatches_decl(self, span: Span, *items: ast.Assign) -> ast.Microbatches:
        return ast.Microbatches(span, items)

    def _mb_assign(self, span: Span, var: Any, rng: ast.Range, ref: ast.PipeRef) -> ast.Assign:
        return ast.Assign(span, None if var is None else str(var), rng, ref)

    def _pipe_ref(self, span: Span, name: Token, index: Any) -> ast.PipeRef:
        return ast.PipeRef(span, str(name), index)

    def _after_decl(
        self, span: Span, later: ast.OpCall, earlier: ast.OpCall, var: Any, rng: Any
    ) -> ast.After:
        return ast.After(span, later, earlier, None if var is None else str(var), rng)

    def _weights_decl(self, span: Span, policy: tuple[str, ast.Expr | None]) -> ast.Weights:
        return ast.Weights(span, policy[0], policy[1])

    def _weights_stash(self, span: Span) -> tuple[str, None]:
        return "stash", None

    def _weights_latest(self, span: Span) -> tuple[str, None]:
        return "latest", None

    def _weights_buffers(self, span: Span, count: ast.Expr) -> tuple[str, ast.Expr]:
        return "buffers", count

    def _frozen_rank(self, span: Span, rank: ast.Expr) -> ast.Frozen:
        one = ast.IntLit(rank.span, 1)
        return ast.Frozen(span, ast.Range(rank.span, rank, ast.Binary(rank.span, "+", rank, one)))

    def _frozen_ranks(self, span: Span, ranks: ast.Range) -> ast.Frozen:
        return ast.Frozen(span, ranks)

    def _chunks_decl(
        self, span: Span, count: ast.Expr, split: Token | None, when: ast.Expr | None
    ) -> ast.ChunksDecl:
        return ast.ChunksDecl(span, count, "tokens" if split is None else str(split), when)

    def _lengths_decl(self, span: Span, *values: ast.Expr) -> ast.ShapeList:
        return ast.ShapeList(span, "lengths", values)

    def _sizes_decl(self, span: Span, *values: ast.Expr) -> ast.ShapeList:
        return ast.ShapeList(span, "sizes", values)

    def _order_rank(self, span: Span, var: Token, body: tuple[ast.Stmt, ...]) -> ast.OrderRank:
        return ast.OrderRank(span, str(var), body)

    def _order_greedy(self, span: Span, *items: Any) -> ast.OrderGreedy:
        prefer: tuple[str, ...] = ()
        priority: tuple[ast.Expr, ...] = ()
        cap = None
        frozen = "best"
        seen: set[str] = set()
        for kind, value, where in items:
            if kind in seen:
                raise fail(
                    "E0207",
                    f"`{kind}` is given twice in `order greedy`",
                    where,
                    help=f"merge them into one `{kind}` line",
                )
            seen.add(kind)
            if kind == "prefer":
                prefer = value
            elif kind == "priority":
                priority = value
            elif kind == "frozen":
                frozen = value
            else:
                cap = value
        return ast.OrderGreedy(span, prefer, priority, cap, frozen)

    def _prefer(self, span: Span, *kinds: Token) -> tuple[str, tuple[str, ...], Span]:
        return "prefer", tuple(str(k) for k in kinds), span

    def _priority(self, span: Span, *keys: ast.Expr) -> tuple[str, tuple[ast.Expr, ...], Span]:
        return "priority", keys, span

    def _cap(self, span: Span, value: ast.Expr) -> tuple[str, ast.Expr, Span]:
        return "cap", value, span

    def _frozen_mode(self, span: Span, mode: Token) -> tuple[str, str, Span]:
        return "frozen", str(mode), span

    def _order_repeat(
        self,
        span: Span,
        var: Token,
        every: Any,
        squeeze: Token | None,
        body: tuple[ast.Stmt, ...],
    ) -> ast.OrderRepeat:
        return ast.OrderRepeat(span, str(var), every, body, squeeze is not None)

    # statements
    def _block(self, span: Span, *stmts: ast.Stmt) -> tuple[ast.Stmt, ...]:
        return stmts

    def _for_stmt(self, span: Span, var: Token, rng: ast.Range, body: Any) -> ast.For:
        return ast.For(span, str(var), rng, body)

    def _if_stmt(self, span: Span, test: ast.Expr, then: Any, otherwise: Any) -> ast.If:
        if otherwise is None:
            otherwise = ()
        elif isinstance(otherwise, ast.If):
            otherwise = (otherwise,)
        return ast.If(span, test, then, otherwise)

    def _op(self, span: Span, name: Token, *rest: Any) -> ast.OpCall:
        *args, slot = rest
        kind = str(name)
        if kind not in ("F", "B", "W", "R", "BW", "U", "E", "L", "P", *_SHARD_OPS):
            raise fail(
                "E0103",
                f"`{kind}` is not an op",
                self._tok(name),
                help="ops are F (forward), B (backward), W (weight grad), R (recompute), "
                "BW (full backward in a split schedule), U (weight update), "
                "E (evict activations), L (load them back), P (frozen forward), "
                "gather and reshard (a sharded stage's parameters)",
            )
        values: dict[str, ast.Expr] = {}
        named = False
        for index, (key, value) in enumerate(a for a in args if a is not None):
            named = named or key is not None
            if key is None and index < 2 and not named:
                key = ("mb", "stage")[index]
            problem = _argument_problem(kind, None if key is None else str(key), values, index)
            if problem is not None:
                raise fail(
                    "E0103",
                    problem,
                    value.span,
                    help="ops take `(mb)`, `(mb, stage)`, or named `mb=` and `stage=`, "
                    "and `chunk=` in a schedule with `chunks`",
                )
            values[str(key)] = value
        if kind == "U" and "mb" in values:
            raise fail(
                "E0103",
                "`U` updates a stage's weights and takes no micro-batch",
                values["mb"].span,
                help="write `U()`, or `U(stage=s)` on a rank that holds several stages",
            )
        if kind in _SHARD_OPS:
            _check_shard_op(kind, values)
        return ast.OpCall(
            span, kind, values.get("mb"), values.get("stage"), slot, values.get("chunk")
        )

    def _evict(self, span: Span, op: ast.OpCall, partner: ast.Expr) -> ast.Evict:
        if op.kind != "E":
            raise fail(
                "E0103",
                f"`{op.kind}` does not send anything to a rank; only `E` does",
                span,
                help="`E(i) -> rank p` evicts F(i)'s activations to rank p; "
                "`L(i)` takes them back from the same rank",
            )
        return ast.Evict(span, op, partner)

    def _pair(self, span: Span, first: ast.OpCall, second: ast.OpCall) -> ast.Pair:
        for call in (first, second):
            if call.kind in ("E", "L"):
                raise fail(
                    "E0103",
                    f"`{call.kind}` moves activations and cannot be part of an overlapped pair",
                    call.span,
                    help=f"write the `{call.kind}` as a statement of its own",
                )
            if call.kind in _SHARD_OPS:
                raise fail(
                    "E0103",
                    f"`{call.kind}()` cannot be part of an overlapped pair",
                    call.span,
                    help=f"write the `{call.kind}()` as a statement of its own",
                )
            if call.kind == "U":
                raise fail(
                    "E0103",
                    "a weight update `U` cannot be part of an overlapped pair",
                    call.span,
                    help="write the `U()` as a statement of its own",
                )
            if call.kind == "P":
                raise fail(
                    "E0103",
                    "a frozen forward `P` cannot be part of an overlapped pair",
                    call.span,
                    help="write the `P(mb)` as a statement of its own",
                )
        return ast.Pair(span, first, second)

    def _arg(self, span: Span, name: Any, value: ast.Expr) -> tuple[str | None, ast.Expr]:
        return (None if name is None else str(name)), value

    def _range(self, span: Span, start: ast.Expr, stop: ast.Expr) -> ast.Range:
        return ast.Range(span, start, stop)

    # expressions
    def _conditional(self, span: Span, test: Any, then: Any, otherwise: Any) -> ast.Conditional:
        return ast.Conditional(span, test, then, otherwise)

    def _or_expr(self, span: Span, *operands: ast.Expr) -> ast.Expr:
        return self._fold(span, ["or"] * (len(operands) - 1), operands)

    def _and_expr(self, span: Span, *operands: ast.Expr) -> ast.Expr:
        return self._fold(span, ["and"] * (len(operands) - 1), operands)

    def _not_(self, span: Span, operand: ast.Expr) -> ast.Unary:
        return ast.Unary(span, "not", operand)

    def _neg(self, span: Span, operand: ast.Expr) -> ast.Expr:
        if isinstance(operand, ast.IntLit):
            return ast.IntLit(span, -operand.value)
        return ast.Unary(span, "-", operand)

    def _comparison(self, span: Span, left: ast.Expr, op: Token, right: ast.Expr) -> ast.Binary:
        return ast.Binary(span, str(op), left, right)

    def _sum(self, span: Span, *parts: Any) -> ast.Expr:
        return self._fold(span, [str(p) for p in parts[1::2]], parts[0::2])

    _product = _sum

    def _fold(self, span: Span, ops: list[str], operands: tuple[Any, ...]) -> ast.Expr:
        result = operands[0]
        for op, right in zip(ops, operands[1:], strict=True):
            whole = Span(self.source, result.span.start, right.span.end)
            result = ast.Binary(whole, op, result, right)
        return result

    def _int_lit(self, span: Span, token: Token) -> ast.IntLit:
        if len(token) > MAX_DIGITS:
            raise fail(
                "E0106",
                f"an integer of {len(token)} digits; at most {MAX_DIGITS} are allowed",
                span,
            )
        return ast.IntLit(span, int(token))

    def _true_lit(self, span: Span) -> ast.BoolLit:
        return ast.BoolLit(span, True)

    def _false_lit(self, span: Span) -> ast.BoolLit:
        return ast.BoolLit(span, False)

    def _name(self, span: Span, token: Token) -> ast.Name:
        return ast.Name(span, str(token))

    def _call(self, span: Span, func: Token, *args: Any) -> ast.Call:
        return ast.Call(span, str(func), tuple(a for a in args if a is not None))


_OP_ARGUMENTS = ("mb", "stage", "chunk")

_SHARD_OPS = ("gather", "reshard")
"""A sharded stage copy's ops a schedule may write (`--shard`; docs/language.md)."""


def _check_shard_op(kind: str, values: dict[str, ast.Expr]) -> None:
    """E0103 for a `gather` or `reshard` given a micro-batch or a chunk: it names a stage
    copy (`gather()`, `gather(stage=s)`)."""
    for key in ("mb", "chunk"):
        if key in values:
            what = "micro-batch" if key == "mb" else "chunk"
            raise fail(
                "E0103",
                f"`{kind}` names a stage copy and takes no {what}",
                values[key].span,
                help=f"write `{kind}()`, or `{kind}(stage=s)` on a rank that holds several stages",
            )


def _argument_problem(
    kind: str, key: str | None, given: dict[str, ast.Expr], index: int
) -> str | None:
    """What is wrong with an op's argument number `index` (named `key`, None for a
    positional one that names nothing) after the arguments `given`; None when nothing."""
    if key is None:
        if index < 2:
            return f"a positional argument of `{kind}` after a named one"
        return f"`{kind}` takes at most two positional arguments, `(mb, stage)`"
    if key not in _OP_ARGUMENTS:
        return f"`{kind}` has no argument `{key}=`"
    if key in given:
        return f"`{kind}` is given `{key}` twice"
    return None
