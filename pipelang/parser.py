"""Text to AST: lark parses `grammars/pipe.lark`, a Transformer builds `pipelang.ast`.

lark's exceptions never escape: they become E0001 / E0002 diagnostics at the offending
token. Imports are resolved here, so the rest of the compiler sees one `ast.File`.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path
from typing import Any

from lark import Lark, Token, Transformer, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput
from lark.exceptions import VisitError
from lark.tree import Meta

from pipelang import ast
from pipelang.diagnostics import Diagnostic, Label, PipelangError, fail
from pipelang.evaluate import MAX_DIGITS
from pipelang.ir import cost_problem
from pipelang.readers import ReadError, read_text
from pipelang.source import SourceFile, Span

MAX_DEPTH = 100
"""Deepest nesting of expressions and blocks, brackets included (E0106): the passes walk
the tree by recursion. A chain of one operator (`a + b - c`) is one level."""
MAX_TERMS = 100
"""Most terms of one such chain (E0106)."""
MAX_BYTES = 1 << 20
"""Largest `.pipe` file (E0106): every command answers within seconds below it."""
MAX_TOKENS = 80_000
"""Most tokens in one file (E0106): lark parses some 20,000 a second, so a megabyte of
short calls (`F(0) F(0) ...`) would take half a minute."""

_CHAINS = ({"+", "-"}, {"*", "//", "%"}, {"and"}, {"or"})
"""Operators that chain left to right at one precedence: `a + b - c` is one level."""

# Token names as lark reports them, spelled as a user would type them.
_TOKEN_TEXT = {
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "LPAR": "`(`",
    "RPAR": "`)`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "COMMA": "`,`",
    "COLON": "`:`",
    "EQUAL": "`=`",
    "NAME": "a name",
    "INT": "an integer",
    "NUMBER": "a number",
    "STRING": "a string",
    "OPNAME": "an op (F, B, W, R, P)",
    "COSTNAME": "a cost name (F, B, W, R, P, C, FB, E, L, A, S, O, KV)",
    "TYPE": "a type (int, bool)",
    "COMPARE": "a comparison",
    "ADD_OP": "`+` or `-`",
    "MUL_OP": "`*`, `//` or `%`",
    "MINUS": "`-`",
    "AT": "`@`",
    "SQUEEZE": "`squeeze`",
    "CHUNK_SPLIT": "`tokens` or `compute`",
    "FROZEN_MODE": "`fill`, `first` or `best`",
    "$END": "end of file",
}


@functools.cache
def _lark() -> Lark:
    grammar = resources.files("pipelang.grammars").joinpath("pipe.lark")
    with resources.as_file(grammar) as path:
        return Lark.open(
            str(path), parser="lalr", propagate_positions=True, maybe_placeholders=True
        )


def stdlib_dir() -> Path:
    """The folder holding the standard-library schedules."""
    with resources.as_file(resources.files("pipelang.schedules")) as path:
        return Path(path)


def read_source(path: Path, display: str | None = None, span: Span | None = None) -> SourceFile:
    """Read a file as UTF-8 text, or fail with E0003 (E0004 when it does not exist)."""
    name = display or str(path)
    if not path.is_file():
        why = "it is a directory" if path.is_dir() else "no such file"
        raise fail("E0004" if span else "E0003", f"cannot read `{name}`: {why}", span)
    try:
        return SourceFile.of(name, read_text(path, MAX_BYTES))
    except ReadError as err:
        if err.reason == "size":
            message = f"`{name}` is larger than the {MAX_BYTES >> 20} MiB a `.pipe` file may be"
            raise fail("E0106", message, span) from None
        if err.reason == "encoding":
            message = f"`{name}` is not UTF-8 text (byte {err.offset} is invalid)"
        elif err.reason == "binary":
            message = f"`{name}` is binary, not a `.pipe` text file"
        else:
            message = f"cannot read `{name}`: {err}"
        code = "E0004" if span and err.reason == "os" else "E0003"
        raise fail(code, message, span) from None


def parse_text(source: SourceFile) -> list[ast.Schedule | ast.FnDecl | ast.Import]:
    """Parse one file's text into its top-level items (imports not yet followed)."""
    _check_brackets(source)
    _check_tokens(source)
    try:
        tree = _lark().parse(source.text)
    except UnexpectedInput as err:
        raise PipelangError([_syntax_error(source, err)]) from None
    try:
        items: list[Any] = _Build(source).transform(tree)
    except VisitError as err:
        if isinstance(err.orig_exc, PipelangError):
            raise err.orig_exc from None
        if not isinstance(err.orig_exc, RecursionError):
            raise
        raise _too_deep(Span(source, 0, 0)) from None
    except RecursionError:
        raise _too_deep(Span(source, 0, 0)) from None
    _check_depth(items)
    return items


def _check_depth(items: list[Any]) -> None:
    """E0106 at the first node nested deeper than `MAX_DEPTH`, or the first chain of one
    operator longer than `MAX_TERMS` (found without recursion)."""
    stack: list[tuple[object, int, int]] = [(item, 1, 1) for item in items]
    while stack:
        node, depth, terms = stack.pop()
        if isinstance(node, tuple):
            stack.extend((child, depth, 1) for child in node)
            continue
        if not isinstance(node, ast.Node):
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(node.span)
        if isinstance(node, ast.Binary):
            left = node.left
            if isinstance(left, ast.Binary) and _chained(left.op, node.op):
                if terms + 1 >= MAX_TERMS:
                    raise fail(
                        "E0106",
                        f"more than {MAX_TERMS} terms joined by `{node.op}` in one expression",
                        node.span,
                        help="name parts of a long expression with `let`",
                    )
                stack.append((left, depth, terms + 1))
            else:
                stack.append((left, depth + 1, 1))
            stack.append((node.right, depth + 1, 1))
            continue
        fields = (getattr(node, f) for f in node.__dataclass_fields__ if f != "span")
        stack.extend((child, depth + 1, 1) for child in fields)


def _chained(inner: str, outer: str) -> bool:
    return any(inner in group and outer in group for group in _CHAINS)


def _check_brackets(source: SourceFile) -> None:
    """E0106 at the first bracket nested deeper than `MAX_DEPTH`, before lark parses
    (which would take seconds over a file of nothing but brackets). Comments and
    strings are skipped."""
    depth = 0
    for match in _BRACKETS.finditer(source.text):
        ch = match.group()
        if ch in "([{":
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(Span(source, match.start(), match.end()))
        elif ch in ")]}":
            depth = max(depth - 1, 0)


_BRACKETS = re.compile(r'#[^\n]*|"[^"\n]*"?|[()\[\]{}]')


def _check_tokens(source: SourceFile) -> None:
    """E0106 at the first token past `MAX_TOKENS`, before lark parses (comments do not
    count; a word, a number, a string or one other character is a token)."""
    count = 0
    for match in _TOKENS.finditer(source.text):
        if match.group().startswith("#"):
            continue
        count += 1
        if count > MAX_TOKENS:
            raise fail(
                "E0106",
                f"the file has more than {MAX_TOKENS:,} tokens",
                Span(source, match.start(), match.end()),
                help="write repeated ops as a loop (`for i in 0..K { ... }`)",
            )


_TOKENS = re.compile(r'#[^\n]*|"[^"\n]*"?|\w+|\S')


def _too_deep(span: Span) -> PipelangError:
    return fail(
        "E0106",
        f"the file nests expressions or blocks more than {MAX_DEPTH} deep",
        span,
        help="name parts of a long expression with `let`",
    )


def parse_file(path: Path, display: str | None = None) -> ast.File:
    """Parse a `.pipe` file and everything it imports into one `ast.File`."""
    source = read_source(path, display)
    items = parse_text(source)
    schedules = [i for i in items if isinstance(i, ast.Schedule)]
    if len(schedules) != 1:
        where = schedules[1].span if len(schedules) > 1 else None
        count = "no" if not schedules else str(len(schedules))
        raise fail(
            "E0006",
            f"`{source.path}` holds {count} schedules; it must hold exactly one",
            where,
            help="put each schedule in a file of its own",
        )
    fns: dict[str, ast.FnDecl] = {}
    _collect_fns(path.resolve(), items, fns, (path.resolve(),), set())
    return ast.File(source, schedules[0], fns)


def _collect_fns(
    path: Path,
    items: list[Any],
    fns: dict[str, ast.FnDecl],
    chain: tuple[Path, ...],
    done: set[Path],
) -> None:
    """Add the `fn`s of `items` and of the files they import; `done` files are skipped, so
    a file imported twice (directly, or by two files one imports) counts once."""
    for item in items:
        if isinstance(item, ast.FnDecl):
            if item.name in fns and fns[item.name] is not item:
                raise fail(
                    "E0102",
                    f"`fn {item.name}` is defined twice",
                    item.span,
                    labels=(),
                    notes=(f"first defined at {fns[item.name].span.location()}",),
                )
            fns[item.name] = item
        if isinstance(item, ast.Import):
            target = _import_target(path, item)
            if target in chain:
                cycle = " -> ".join(p.name for p in (*chain, target))
                raise fail(
                    "E0005",
                    f"import cycle: {cycle}",
                    item.span,
                    help="imports carry `fn`s only; move shared ones to a separate file",
                )
            if target in done:
                continue
            done.add(target)
            imported = read_source(target, item.path, item.span)
            _collect_fns(target, parse_text(imported), fns, (*chain, target), done)


def _import_target(importer: Path, item: ast.Import) -> Path:
    relative = (importer.parent / item.path).resolve()
    if relative.exists():
        return relative
    stdlib = stdlib_dir() / (item.path if item.path.endswith(".pipe") else item.path + ".pipe")
    return stdlib.resolve() if stdlib.exists() else relative


def _syntax_error(source: SourceFile, err: UnexpectedInput) -> Diagnostic:
    offset = min(getattr(err, "pos_in_stream", None) or 0, len(source.text))
    token = getattr(err, "token", None)
    at_end = token is not None and token.type == "$END"
    if isinstance(err, UnexpectedEOF) or at_end:
        return _unexpected_end(source)
    if isinstance(err, UnexpectedCharacters):
        char = source.text[offset]
        shown = repr(char)[1:-1] if not char.isprintable() else char
        message = f"unexpected character `{shown}`"
        hint = {"/": "use `//` for integer division", ";": _SEMICOLON}.get(char)
        if char == "/" and source.text[offset : offset + 2] == "//":
            hint = None
        return Diagnostic("E0001", message, Span(source, offset, offset + 1), help=hint)
    expected = sorted(getattr(err, "expected", None) or getattr(err, "accepts", None) or ())
    wanted = ", ".join(dict.fromkeys(_token_text(e) for e in expected))
    text = str(token) if token is not None else ""
    end = offset + max(1, len(text))
    help_text = f"expected {wanted}" if wanted else None
    if token is not None and token.type == "MUL_OP" and text == "/":
        help_text = "use `//` for integer division"
    line_before = source.text[source.text.rfind("\n", 0, offset) + 1 : offset]
    if re.search(r"\bin\s+range\s*\(", line_before):
        help_text = "a range is written `0..N` (or `a..b`), not `range(N)`"
    return Diagnostic("E0001", f"unexpected `{text}`", Span(source, offset, end), help=help_text)


_SEMICOLON = "statements end with the line (or the next statement); drop the `;`"


def _token_text(name: str) -> str:
    """How a user would write a token lark expects: `&` or `after`, never `AMPERSAND`."""
    if name in _TOKEN_TEXT:
        return _TOKEN_TEXT[name]
    literal = _literals().get(name)
    return f"`{literal}`" if literal is not None else "another token"


@functools.cache
def _literals() -> dict[str, str]:
    """The terminals of the grammar that are one fixed string, by lark's name."""
    return {t.name: t.pattern.value for t in _lark().terminals if t.pattern.type == "str"}


def _unexpected_end(source: SourceFile) -> Diagnostic:
    """E0002 at the end of the text, pointing at the `{` left open if there is one."""
    end = len(source.text.rstrip())
    where = Span(source, end, end)
    brace = _unclosed_brace(source.text)
    if brace is None:
        return Diagnostic(
            "E0002",
            "unexpected end of file",
            where,
            help="the file ends inside a declaration or an expression",
        )
    return Diagnostic(
        "E0002",
        "unexpected end of file: a `{` is never closed",
        where,
        labels=(Label(Span(source, brace, brace + 1), "this `{` is not closed"),),
        help="add the missing `}`",
    )


def _unclosed_brace(text: str) -> int | None:
    """Offset of the `{` most likely left open, skipping comments and strings.

    Brace counting alone blames the outermost block; indentation tells better: a `}` that
    starts a line closes the `{` whose line is indented the same, so the first `{` that a
    differently indented `}` would close is the one missing its `}`.
    """
    opened: list[int] = []
    suspect: int | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "#":
            i = text.find("\n", i)
            if i < 0:
                break
        elif ch == '"':
            close = text.find('"', i + 1)
            i = close if close >= 0 else len(text)
        elif ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            start = opened.pop()
            line_start = text.rfind("\n", 0, i) + 1
            starts_line = not text[line_start:i].strip()
            if suspect is None and starts_line and _indent(text, i) != _indent(text, start):
                suspect = start
        i += 1
    if suspect is not None and opened:
        return suspect
    return opened[-1] if opened else None


def _indent(text: str, offset: int) -> int:
    line_start = text.rfind("\n", 0, offset) + 1
    line = text[line_start:]
    return len(line) - len(line.lstrip(" \t"))


class _Build(Transformer[Token, Any]):
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
        if kind not in ("F", "B", "W", "R", "BW", "U", "E", "L", "P"):
            raise fail(
                "E0103",
                f"`{kind}` is not an op",
                self._tok(name),
                help="ops are F (forward), B (backward), W (weight grad), R (recompute), "
                "BW (full backward in a split schedule), U (weight update), "
                "E (evict activations), L (load them back), P (frozen forward)",
            )
        values: dict[str, ast.Expr] = {}
        named = False
        for index, (key, value) in enumerate(a for a in args if a is not None):
            named = named or key is not None
            if key is None and index < 2 and not named:
                key = ("mb", "stage")[index]
            if key not in ("mb", "stage", "chunk") or key in values:
                raise fail(
                    "E0103",
                    f"bad argument to `{kind}`",
                    value.span,
                    help="ops take `(mb)`, `(mb, stage)`, or named `mb=` and `stage=`, "
                    "and `chunk=` in a schedule with `chunks`",
                )
            values[key] = value
        if kind == "U" and "mb" in values:
            raise fail(
                "E0103",
                "`U` updates a stage's weights and takes no micro-batch",
                values["mb"].span,
                help="write `U()`, or `U(stage=s)` on a rank that holds several stages",
            )
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
