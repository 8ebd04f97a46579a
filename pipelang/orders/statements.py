"""`let` / `for` / `if` / op statements compiled into closures that emit ops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipelang import ast
from pipelang.diagnostics import fail
from pipelang.evaluate import (
    BOOL,
    Const,
    Env,
    Scope,
    compile_expr,
    compile_int,
    infer,
    iteration_limit,
    too_large,
)
from pipelang.ir import Kind

Emit = Callable[
    [ast.OpCall, Kind, int | None, int | None, int | None, bool, int | None, int | None], None
]
"""Called once per op an op statement runs: (statement, kind, mb, stage, slot, fused,
partner, chunk), unset ones None; `fused` joins the op to the one emitted before it (`&`,
`BW`); `partner` is the rank an `E(i) -> rank p` evicts to."""
Block = Callable[[Env, Emit], None]


@dataclass
class Budget:
    """Loop iterations still allowed in one expansion (E0106 beyond)."""

    limit: int = field(default_factory=iteration_limit)
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = self.limit

    def spend(self, count: int, node: ast.Node) -> None:
        self.left -= count
        if self.left < 0:
            raise too_large(f"the order runs more than {self.limit} loop iterations", node.span)


def compile_block(stmts: tuple[ast.Stmt, ...], scope: Scope, budget: Budget) -> Block:
    """Compile statements; names a `let` or `for` binds are visible to what follows only."""
    steps: list[Block] = []
    if any(isinstance(stmt, ast.Let) for stmt in stmts):
        scope = scope.block()
    for stmt in stmts:
        if isinstance(stmt, ast.Let):
            type_, value = infer(stmt.value, scope)
            if isinstance(value, Const):
                scope.declare(stmt.name, stmt.span, type_, value.value)
                continue
            steps.append(_let(stmt.name, value))
            scope.declare(stmt.name, stmt.span, type_, None)
        elif isinstance(stmt, ast.For):
            steps.append(_for(stmt, scope, budget))
        elif isinstance(stmt, ast.If):
            steps.append(_if(stmt, scope, budget))
        elif isinstance(stmt, ast.Pair):
            steps.append(_pair(_op(stmt.first, scope), _op(stmt.second, scope, fused=True)))
        elif isinstance(stmt, ast.Evict):
            steps.append(_op(stmt.op, scope, partner=compile_int(stmt.partner, scope)))
        else:
            _check_partnerless(stmt)
            steps.append(_op(stmt, scope))

    if len(steps) == 1:
        return steps[0]

    def run(env: Env, emit: Emit) -> None:
        for step in steps:
            step(env, emit)

    return run


def _let(name: str, value: Callable[[Env], object]) -> Block:
    def run(env: Env, emit: Emit) -> None:
        env[name] = value(env)  # type: ignore[assignment]

    return run


def _for(stmt: ast.For, scope: Scope, budget: Budget) -> Block:
    start = compile_int(stmt.range.start, scope)
    stop = compile_int(stmt.range.stop, scope)
    body = compile_block(stmt.body, scope.with_name(stmt.var, stmt.span), budget)
    var = stmt.var

    def run(env: Env, emit: Emit) -> None:
        first, last = start(env), stop(env)
        budget.spend(max(0, last - first), stmt)
        for i in range(first, last):
            env[var] = i
            body(env, emit)

    return run


def _if(stmt: ast.If, scope: Scope, budget: Budget) -> Block:
    test = compile_expr(stmt.test, scope, BOOL)
    then = compile_block(stmt.then, scope, budget)
    otherwise = compile_block(stmt.otherwise, scope, budget)
    if isinstance(test, Const):
        return then if test.value else otherwise

    def run(env: Env, emit: Emit) -> None:
        (then if test(env) else otherwise)(env, emit)

    return run


def _pair(first: Block, second: Block) -> Block:
    def run(env: Env, emit: Emit) -> None:
        first(env, emit)
        second(env, emit)

    return run


def _check_partnerless(stmt: ast.OpCall) -> None:
    """An `E` outside `E(i) -> rank p` has nowhere to go (E0103)."""
    if stmt.kind == "E":
        raise fail(
            "E0103",
            "`E` needs the rank to evict to",
            stmt.span,
            help="write `E(i) -> rank p`: F(i)'s activations go to rank p until `L(i)`",
        )


def _op(
    stmt: ast.OpCall,
    scope: Scope,
    fused: bool = False,
    partner: Callable[[Env], int] | None = None,
) -> Block:
    """One op; `BW` is a B with its W fused to it (a full backward), `fused` joins the
    (first) op to the one before it, `partner` is where an `E` evicts to."""
    mb, stage, slot, chunk = (
        None if e is None else compile_int(e, scope)
        for e in (stmt.mb, stmt.stage, stmt.slot, stmt.chunk)
    )
    kinds = ((Kind.B, fused), (Kind.W, True)) if stmt.kind == "BW" else ((Kind(stmt.kind), fused),)

    def run(env: Env, emit: Emit) -> None:
        args = (
            None if mb is None else mb(env),
            None if stage is None else stage(env),
            None if slot is None else slot(env),
        )
        peer = None if partner is None else partner(env)
        part = None if chunk is None else chunk(env)
        for kind, joined in kinds:
            emit(stmt, kind, *args, joined, peer, part)

    return run
