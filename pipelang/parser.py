"""Text to AST: lark parses `grammars/pipe.lark`, a Transformer builds `pipelang.ast`
(`ast_builder.py`).

lark's exceptions never escape: they become E0001 / E0002 diagnostics at the offending
token. Imports are resolved here, so the rest of the compiler sees one `ast.File`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from lark import Lark, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, __version__
from lark.exceptions import VisitError

from pipelang import ast
from pipelang.ast_builder import AstBuilder
from pipelang.diagnostics import Diagnostic, Label, PipelangError, fail, nearest, quote
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


SAVED_PARSER = "pipe.lark.json"
"""lark's parser for `pipe.lark`, saved beside it as JSON (`save_parser`): building it
from the grammar takes 0.3-0.5 s, which every command would pay; loading it, about 10 ms.
It is used only where it was saved from this grammar's exact text by this lark version
(its `stamp`); anything else builds from the grammar, and the tests check that the saved
one is current (tests/test_parser_table.py)."""


@functools.cache
def _lark() -> Lark:
    grammar = resources.files("pipelang.grammars")
    text = grammar.joinpath("pipe.lark").read_text(encoding="utf-8")
    try:
        saved = json.loads(
            grammar.joinpath(SAVED_PARSER).read_text(encoding="utf-8"),
            object_pairs_hook=_numbered,
        )
    except (OSError, ValueError):
        saved = None
    if saved is not None and saved.get("stamp") == _stamp(text):
        return Lark._load_from_dict(saved["data"], saved["memo"])
    return build_parser(text)


def build_parser(grammar: str) -> Lark:
    """lark's LALR parser for the grammar's text."""
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def save_parser(folder: Path) -> Path:
    """Write FOLDER/pipe.lark.json, the parser built from FOLDER/pipe.lark (the checkout's
    grammars/ after an edit of the grammar: `python -c "from pathlib import Path; from
    pipelang.parser import save_parser; save_parser(Path('grammars'))"`)."""
    from lark.grammar import Rule
    from lark.lexer import TerminalDef

    text = (folder / "pipe.lark").read_text(encoding="utf-8")
    data, memo = build_parser(text).memo_serialize([TerminalDef, Rule])
    out = folder / SAVED_PARSER
    saved = {"stamp": _stamp(text), "data": data, "memo": memo}
    out.write_text(json.dumps(saved, sort_keys=True) + "\n", encoding="utf-8")
    return out


def _stamp(grammar: str) -> dict[str, str]:
    return {"grammar_sha256": hashlib.sha256(grammar.encode()).hexdigest(), "lark": __version__}


def _numbered(pairs: list[tuple[str, Any]]) -> dict[Any, Any]:
    """A JSON object with its integer keys back (lark's parse states and memo are keyed by
    numbers, which JSON writes as strings; no name in lark's tables is all digits)."""
    return {int(key) if key.isdigit() else key: value for key, value in pairs}


def stdlib_dir() -> Path:
    """The folder holding the standard-library schedules."""
    with resources.as_file(resources.files("pipelang.schedules")) as path:
        return Path(path)


def read_source(path: Path, display: str | None = None, span: Span | None = None) -> SourceFile:
    """Read a file as UTF-8 text, or fail with E0003 (E0004 when it does not exist)."""
    name = display or str(path)
    try:
        found = path.is_file()
        why = "" if found else "it is a directory" if path.is_dir() else "no such file"
    except OSError as err:  # a name too long for the file system, say
        found, why = False, err.strerror or str(err)
    if not found:
        raise fail("E0004" if span else "E0003", f"cannot read {quote(name)}: {why}", span)
    try:
        return SourceFile.of(name, read_text(path, MAX_BYTES))
    except ReadError as err:
        if err.reason == "size":
            limit = MAX_BYTES >> 20
            message = f"{quote(name)} is larger than the {limit} MiB a `.pipe` file may be"
            raise fail("E0106", message, span) from None
        if err.reason == "encoding":
            message = f"{quote(name)} is not UTF-8 text (byte {err.offset} is invalid)"
        elif err.reason == "binary":
            message = f"{quote(name)} is binary, not a `.pipe` text file"
        else:
            message = f"cannot read {quote(name)}: {err}"
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
        items: list[Any] = AstBuilder(source).transform(tree)
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
    if _exists(relative):
        return relative
    stdlib = stdlib_dir() / (item.path if item.path.endswith(".pipe") else item.path + ".pipe")
    return stdlib.resolve() if _exists(stdlib) else relative


def _exists(path: Path) -> bool:
    """`path.exists()`, False where the file system cannot tell (a name too long for it:
    `read_source` then says why it cannot be read)."""
    try:
        return path.exists()
    except OSError:
        return False


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
    return Diagnostic(
        "E0001",
        f"unexpected `{text}`",
        Span(source, offset, end),
        help=_misspelled_keyword(line_before) or help_text,
    )


def keywords() -> frozenset[str]:
    """The grammar's words (`schedule`, `pipeline`, `order`, ...), which no name may be."""
    return frozenset(v for v in _literals().values() if v.isidentifier())


def _misspelled_keyword(line_before: str) -> str | None:
    """ "did you mean `pipeline`?" when the line starts with a word that is no keyword but
    close to one (`pipline main: ...`, `lett x = 1`) and the parse failed right after it."""
    found = re.fullmatch(r"\s*([A-Za-z_]\w*)\s+", line_before)
    if found is None:
        return None
    word = found.group(1)
    words = sorted(keywords())
    if word in words:
        return None
    close = nearest(word, words, cutoff=0.75)
    return f"{quote(word)} is not a keyword: did you mean `{close}`?" if close else None


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
