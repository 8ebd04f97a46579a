"""Integer expressions and order statements, compiled once into Python closures.

Names are resolved and types (`int` or `bool`) checked when an expression is compiled,
so an unknown identifier is an error even on a branch that never runs. Evaluation then
only does arithmetic; the single run-time error is division by zero. Nothing from a
`.pipe` file is passed to `eval`: every closure below is written out by hand.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pipelang import ast
from pipelang.diagnostics import PipelangError, fail, nearest
from pipelang.source import Span

Value = int | bool
Env = dict[str, Value]
Evaluator = Callable[[Env], Value]
IntEvaluator = Callable[[Env], int]

INT, BOOL = "int", "bool"
MAX_OPS = 150_000
"""Most ops a schedule may have (micro-batches x stages x kinds), and so most ranks and
placed stages, unless `--max-ops` says otherwise (E0106): every command handles a
schedule this large within about 10 s on a 2-core VM (docs/language.md, "Limits")."""
SYNTHESIS_MAX_OPS = 8192
"""The most ops `synthesize` orders (E0605; `--max-ops` may lower it): D = 16, N = 128
with B and W split (6144 ops) solves in about 35 s within 650 MB here, and the solver's
memory grows with the ops. Here, not in the synthesizer, so that reading it (the CLI's
help) does not import the synthesizer."""
ITERATIONS_PER_OP = 4
"""Loop iterations of an order, and elements of one range, allowed per allowed op."""
_max_ops: ContextVar[int] = ContextVar("max_ops", default=MAX_OPS)
MAX_DIGITS = 18
"""Most digits of an integer literal or `-p` value (E0106); 18 digits fit in 64 bits."""
MAX_INT = 2**63 - 1
"""The largest magnitude of an integer a schedule computes (E0106): a few chained
squarings would otherwise take minutes and gigabytes."""
MAX_INLINED = 1000
"""Most `fn` bodies one expression may expand to, counting calls inside calls (E0106)."""

_ARITH: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
_COMPARE: dict[str, Callable[[Value, Value], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


@dataclass(frozen=True)
class Scope:
    """The names visible at a point, with their types, and the `fn`s of the file.

    `constants` holds the names whose value is already known (parameters, schedule-level
    `let`s, a block's `let`s of constants): expressions over them are folded when compiled.
    """

    names: Mapping[str, str]
    fns: Mapping[str, ast.FnDecl]
    constants: Mapping[str, Value] = field(default_factory=dict)

    def with_name(
        self, name: str, span: Span | None, type_: str = INT, why: str | None = None
    ) -> Scope:
        """The scope with a new name bound at `span`; a name never shadows another
        (E0102), and `why` says where an implicit one comes from."""
        self._check_new(name, span, why)
        return Scope({**self.names, name: type_}, self.fns, self.constants)

    def block(self) -> Scope:
        """A scope of its own for a block's `let`s to `declare` into: one copy per block,
        not one per `let` (a block of 10^4 `let`s would otherwise take seconds)."""
        return Scope(dict(self.names), self.fns, dict(self.constants))

    def declare(self, name: str, span: Span | None, type_: str, value: Value | None) -> None:
        """Bind `name` in this scope in place (a `block()` scope; the names declared so
        far are what later statements see), as a constant when `value` is known."""
        self._check_new(name, span, None)
        self.names[name] = type_  # type: ignore[index]
        if value is not None:
            self.constants[name] = value  # type: ignore[index]

    def _check_new(self, name: str, span: Span | None, why: str | None) -> None:
        if name in self.names:
            raise fail(
                "E0102",
                f"`{name}` would shadow the `{name}` already defined" + (f": {why}" if why else ""),
                span,
                help="pick another name; a name cannot be shadowed",
            )


class Const:
    """An evaluator whose value is known when compiled; lets parents fold themselves."""

    __slots__ = ("value",)

    def __init__(self, value: Value) -> None:
        self.value = value

    def __call__(self, env: Env) -> Value:
        return self.value


@dataclass(frozen=True)
class _Calls:
    """The `fn`s being inlined around a point, and how many bodies one expression inlined.

    Each call compiles its fn's body anew, so without a bound `fn f1(x) = f0(x) + f0(x)`,
    `fn f2(x) = f1(x) + f1(x)`, ... would take time exponential in the file's length.
    """

    chain: tuple[str, ...] = ()
    inlined: list[int] = field(default_factory=lambda: [0])

    def enter(self, name: str, call: ast.Call) -> _Calls:
        self.inlined[0] += 1
        if self.inlined[0] > MAX_INLINED:
            raise fail(
                "E0106",
                f"this expression expands to more than {MAX_INLINED} `fn` bodies",
                call.span,
                help="call fewer `fn`s inside `fn`s",
            )
        return _Calls((*self.chain, name), self.inlined)


def compile_expr(expr: ast.Expr, scope: Scope, want: str | None = None) -> Evaluator:
    """Compile `expr`; if `want` is given, its type must be `want` (E0105 otherwise)."""
    type_, fn = _compile(expr, scope, _Calls())
    if want is not None and type_ != want:
        raise fail("E0105", f"expected {_article(want)}, found {_article(type_)}", expr.span)
    return fn


def infer(expr: ast.Expr, scope: Scope) -> tuple[str, Evaluator]:
    """Compile `expr` whatever its type; returns the type and the evaluator."""
    return _compile(expr, scope, _Calls())


def compile_int(expr: ast.Expr, scope: Scope) -> IntEvaluator:
    """Compile an expression that must be an integer."""
    return compile_expr(expr, scope, INT)  # type: ignore[return-value]


def _article(type_: str) -> str:
    return "an integer" if type_ == INT else "a boolean"


def _compile(expr: ast.Expr, scope: Scope, calling: _Calls) -> tuple[str, Evaluator]:
    match expr:
        case ast.IntLit(value=value):
            return INT, Const(value)
        case ast.BoolLit(value=value):
            return BOOL, Const(value)
        case ast.Name(id=name):
            if name not in scope.names:
                raise _unknown(expr, name, scope)
            if name in scope.constants:
                return scope.names[name], Const(scope.constants[name])
            return scope.names[name], operator.itemgetter(name)
        case ast.Unary(op="-", operand=operand):
            inner = _typed(operand, scope, calling, INT)
            return INT, _fold(lambda env: -inner(env), inner)
        case ast.Unary(operand=operand):
            inner = _typed(operand, scope, calling, BOOL)
            return BOOL, _fold(lambda env: not inner(env), inner)
        case ast.Binary():
            return _binary(expr, scope, calling)
        case ast.Call():
            return _call(expr, scope, calling)
        case ast.Conditional(test=test, then=then, otherwise=otherwise):
            cond = _typed(test, scope, calling, BOOL)
            then_type, then_fn = _compile(then, scope, calling)
            else_fn = _typed(otherwise, scope, calling, then_type)
            if isinstance(cond, Const):
                return then_type, then_fn if cond.value else else_fn
            return then_type, lambda env: then_fn(env) if cond(env) else else_fn(env)
    raise AssertionError(f"unknown expression node {expr!r}")


def _fold(fn: Evaluator, *children: Evaluator) -> Evaluator:
    """`fn` itself, or its value as a `Const` when every child is constant."""
    if not all(isinstance(c, Const) for c in children):
        return fn
    try:
        return Const(fn({}))
    except PipelangError:
        return fn  # e.g. a division by zero on a branch that may never run


def _typed(expr: ast.Expr, scope: Scope, calling: _Calls, want: str) -> Evaluator:
    type_, fn = _compile(expr, scope, calling)
    if type_ != want:
        raise fail("E0105", f"expected {_article(want)}, found {_article(type_)}", expr.span)
    return fn


def _binary(expr: ast.Binary, scope: Scope, calling: _Calls) -> tuple[str, Evaluator]:
    op = expr.op
    if op in ("and", "or"):
        left, right = (_typed(e, scope, calling, BOOL) for e in (expr.left, expr.right))
        if op == "and":
            return BOOL, _fold(lambda env: left(env) and right(env), left, right)
        return BOOL, _fold(lambda env: left(env) or right(env), left, right)
    if op in ("==", "!="):
        left_type, left = _compile(expr.left, scope, calling)
        right = _typed(expr.right, scope, calling, left_type)
        return BOOL, _apply(_COMPARE[op], left, right)
    left, right = (_typed(e, scope, calling, INT) for e in (expr.left, expr.right))
    if op in _COMPARE:
        return BOOL, _apply(_COMPARE[op], left, right)
    if op in _ARITH:
        return INT, _arith(_ARITH[op], left, right, expr)
    if op in ("//", "%"):
        divide = operator.floordiv if op == "//" else operator.mod
        if isinstance(right, Const) and right.value != 0:
            return INT, _apply(divide, left, right)
        return INT, _fold(_division(divide, left, right, expr), left, right)
    raise fail(
        "E0001",
        f"`{op}` is not an operator",
        expr.span,
        help="use `//` for integer division" if op == "/" else None,
    )


def _apply(fn: Callable[[Any, Any], Value], left: Evaluator, right: Evaluator) -> Evaluator:
    """`fn(left, right)`, specialised when one side is constant (the common case)."""
    if isinstance(right, Const):
        constant = right.value
        return _fold(lambda env: fn(left(env), constant), left)
    if isinstance(left, Const):
        value = left.value
        return lambda env: fn(value, right(env))
    return lambda env: fn(left(env), right(env))


def _arith(
    fn: Callable[[int, int], int], left: Evaluator, right: Evaluator, expr: ast.Binary
) -> Evaluator:
    """`fn(left, right)` for +, - and *, its result checked against MAX_INT (E0106);
    as `_apply`, specialised for a constant side, with the check inline: expansion
    evaluates this once per op."""
    bound = MAX_INT

    def too_large() -> PipelangError:
        return fail(
            "E0106",
            f"`{_text(expr)}` is too large: a schedule's integers are at most 2^63 - 1 "
            "in magnitude",
            expr.span,
        )

    if isinstance(right, Const):
        constant = right.value

        def with_constant(env: Env) -> int:
            value = fn(left(env), constant)  # type: ignore[arg-type]
            if -bound <= value <= bound:
                return value
            raise too_large()

        return _fold(with_constant, left)

    def both(env: Env) -> int:
        value = fn(left(env), right(env))  # type: ignore[arg-type]
        if -bound <= value <= bound:
            return value
        raise too_large()

    return both


def _division(
    divide: Callable[[int, int], int], left: Evaluator, right: Evaluator, expr: ast.Binary
) -> Evaluator:
    def run(env: Env) -> int:
        divisor = right(env)
        if divisor == 0:
            raise fail(
                "E0104",
                f"division by zero in `{_text(expr)}`",
                expr.span,
                notes=(f"`{_text(expr.right)}` is 0 here",),
            )
        return divide(left(env), divisor)  # type: ignore[arg-type]

    return run


def _call(expr: ast.Call, scope: Scope, calling: _Calls) -> tuple[str, Evaluator]:
    name = expr.func
    if name in ("min", "max") and name not in scope.fns:
        if not expr.args:
            raise fail("E0103", f"`{name}` needs at least one argument", expr.span)
        args = [_typed(a, scope, calling, INT) for a in expr.args]
        pick = min if name == "min" else max
        return INT, _fold(lambda env: pick(a(env) for a in args), *args)
    fn = scope.fns.get(name)
    if fn is None:
        raise _unknown(expr, name, scope, function=True)
    if name in calling.chain:
        raise fail(
            "E0103",
            f"`fn {name}` calls itself",
            expr.span,
            help="fns are not recursive; write the closed form",
        )
    if len(expr.args) != len(fn.params):
        raise fail(
            "E0103", f"`{name}` takes {len(fn.params)} arguments, {len(expr.args)} given", expr.span
        )
    args = [_typed(a, scope, calling, INT) for a in expr.args]
    body_scope = Scope(dict.fromkeys(fn.params, INT), scope.fns)
    body_type, body = _compile(fn.body, body_scope, calling.enter(name, expr))
    params = fn.params

    def run(env: Env) -> Value:
        return body(dict(zip(params, (a(env) for a in args), strict=True)))

    return body_type, _fold(run, *args)


def _unknown(node: ast.Node, name: str, scope: Scope, function: bool = False) -> Exception:
    known = [*scope.fns, "min", "max"] if function else list(scope.names)
    close = nearest(name, known)
    kind = "function" if function else "name"
    return fail(
        "E0101",
        f"unknown {kind} `{name}`",
        node.span,
        help=f"did you mean `{close}`?" if close else None,
    )


def _text(node: ast.Node) -> str:
    return node.span.source.text[node.span.start : node.span.end]


def max_ops() -> int:
    """The most ops the schedule being expanded may have (`op_limit`)."""
    return _max_ops.get()


def iteration_limit() -> int:
    """The most loop iterations of one order, and elements of one range."""
    return ITERATIONS_PER_OP * _max_ops.get()


@contextmanager
def op_limit(ops: int) -> Iterator[None]:
    """Expand with at most `ops` ops (`--max-ops`); the iteration limits follow."""
    token = _max_ops.set(ops)
    try:
        yield
    finally:
        _max_ops.reset(token)


def too_large(what: str, span: Span | None) -> PipelangError:
    """E0106 for a schedule past `--max-ops` or the limits that follow from it."""
    return fail(
        "E0106",
        what,
        span,
        help=f"pass smaller parameters; `--max-ops` (now {max_ops()}) raises the limit, "
        "for a schedule that is really this big",
    )


def eval_range(rng: ast.Range, scope: Scope, env: Env) -> range:
    """Evaluate `a..b` once, refusing ranges longer than `iteration_limit()` (E0106)."""
    start, stop = compile_int(rng.start, scope)(env), compile_int(rng.stop, scope)(env)
    limit = iteration_limit()
    if stop - start > limit:
        raise too_large(
            f"range `{_text(rng)}` has {stop - start} elements, more than the limit of {limit}",
            rng.span,
        )
    return range(start, stop)


@contextmanager
def nesting_limit(span: Span) -> Iterator[None]:
    """Turn Python's recursion limit, hit by `fn`s that call `fn`s many levels deep, into
    E0106 at `span` (the parser already bounds how deep one expression nests)."""
    try:
        yield
    except RecursionError:
        raise fail(
            "E0106",
            "`fn` calls nest too deeply to evaluate",
            span,
            help="call fewer `fn`s inside `fn`s",
        ) from None


def constant_scope(env: Mapping[str, Value], fns: Mapping[str, ast.FnDecl]) -> Scope:
    """A scope in which every name of `env` is a constant of its value's type."""
    types = {k: BOOL if isinstance(v, bool) else INT for k, v in env.items()}
    return Scope(types, fns, dict(env))
