"""Diagnostics: user errors with a code, a source position, notes and help.

Rendered rustc-style::

    error[E0306]: the schedule deadlocks: 2 ops wait on each other
      --> bad.pipe:9:22
       |
     9 |     order rank r { B(0) F(0) }
       |                    ^^^^
       = note: ...
       = help: ...

Compiler bugs are `InternalError`, never a `Diagnostic`.
"""

from __future__ import annotations

import bisect
import difflib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pipelang.source import Span, one_line


@dataclass(frozen=True, slots=True)
class Label:
    """A secondary position in a diagnostic, with a short message."""

    span: Span
    message: str


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One problem found in user input."""

    code: str
    message: str
    span: Span | None = None
    labels: tuple[Label, ...] = ()
    notes: tuple[str, ...] = ()
    help: str | None = None
    severity: str = "error"

    @property
    def file(self) -> str | None:
        """The file the diagnostic points into (None for one with no position)."""
        return None if self.span is None else self.span.source.path

    @property
    def line(self) -> int | None:
        """Its 1-based line."""
        return None if self.span is None else self.span.line

    @property
    def column(self) -> int | None:
        """Its 1-based column."""
        return None if self.span is None else self.span.column

    def sort_key(self) -> tuple[str, int, str]:
        if self.span is None:
            return ("", -1, self.code)
        return (*self.span.sort_key(), self.code)

    def render(self) -> str:
        """The human form: header, location, source excerpt with caret, notes, help."""
        lines = [f"{self.severity}[{self.code}]: {clip(self.message)}"]
        if self.span is not None:
            lines.extend(_excerpt(self.span, "", primary=True))
        for label in self.labels:
            lines.extend(_excerpt(label.span, clip(label.message), primary=False))
        gutter = " " * (_gutter_width(self) + 1)
        if self.notes or self.help:
            lines.append(f"{gutter}|")
        for note in self.notes:
            first, *rest = clip(note).split("\n")
            lines.append(f"{gutter}= note: {first}")
            lines.extend(f"{gutter}  {line}" for line in rest)
        if self.help:
            lines.append(f"{gutter}= help: {clip(self.help)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        """The machine form: the same fields as `render`, for editors and tests."""

        def where(span: Span) -> dict[str, object]:
            line, col = span.source.line_col(span.start)
            end_line, end_col = span.source.line_col(max(span.start, span.end))
            return {
                "file": span.source.path,
                "line": line,
                "column": col,
                "end_line": end_line,
                "end_column": end_col,
            }

        location = where(self.span) if self.span else None
        return {
            "severity": self.severity,
            "code": self.code,
            "message": clip(self.message),
            "file": location["file"] if location else None,
            "line": location["line"] if location else None,
            "column": location["column"] if location else None,
            "location": location,
            "labels": [
                {"message": clip(lb.message), "location": where(lb.span)} for lb in self.labels
            ],
            "notes": [clip(note) for note in self.notes],
            "help": None if self.help is None else clip(self.help),
        }


QUOTED = 60
"""The most characters of a quoted piece of input (`name`) a message shows."""
MESSAGE = 1000
"""The most characters of one message, note or help (what a `require`'s own text says, too)."""
_QUOTE = re.compile(r"`([^`\n]*)`")
"""Every quoted piece, paired left to right (matching only the long ones would pair the
text between two quotes as if it were one)."""


_RUN = re.compile(rf"[^\s`]{{{QUOTED + 1},}}")
"""A run of characters without a space longer than any word: text the user typed."""


def clip(text: str, runs: bool = False, longest: int = QUOTED) -> str:
    """`text` with every quoted piece longer than `longest` characters cut in the middle,
    saying how long it was, and cut at MESSAGE characters: a 300,000-character name does
    not make a 300 KB message. With `runs`, an unquoted run of more than `longest`
    characters without a space is cut so too (argparse's messages quote the command
    line their own way, or not at all)."""

    def cut(found: re.Match[str]) -> str:
        return found[0] if len(found[1]) <= longest else _cut(found[1])

    text = _QUOTE.sub(cut, text)
    if runs:
        run = _RUN if longest == QUOTED else re.compile(rf"[^\s`]{{{longest + 1},}}")
        text = run.sub(lambda found: _cut(found[0]), text)
    if len(text) > MESSAGE:
        return f"{text[:MESSAGE]}... (cut at {MESSAGE:,} of {len(text):,} characters)"
    return text


ECHOED = 200
"""The most characters of user text a message holds whole (`quote`); rendering cuts a
quoted piece further, at QUOTED."""


def quote(text: object) -> str:
    """User text as a message shows it: in backticks, each character that is not
    printable (a line break, a control) as its escape, a backtick as `'`, and past ECHOED
    characters cut in the middle, saying how long it was. The one way a message echoes
    what a user typed (a name, a code, a path), so that no input makes a message long or
    breaks its line."""
    whole = str(text)
    if len(whole) > ECHOED:
        return _cut(whole)
    return f"`{_printable(whole)}`"


def _cut(whole: str) -> str:
    keep = QUOTED // 2
    head, tail = _printable(whole[:keep]), _printable(whole[-keep // 2 :])
    return f"`{head}...{tail}` ({len(whole):,} characters)"


def _printable(text: str) -> str:
    return one_line(text).replace("`", "'")


NEAREST_LONGEST = 64
"""The longest name a "did you mean" compares by its spelling (a longer one is matched
only up to case): comparing two names costs their lengths' product."""
NEAREST_COMPARED = 300
"""The most candidates one "did you mean" compares: half nearest in spelling order (a
typo keeps a name's start), half nearest in length. A file of 4,000 long names asked for
one took 39 s in difflib."""


def nearest(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The candidate a misspelled `word` most likely meant: one equal up to case, else
    the closest spelling (difflib's ratio at least `cutoff`), else None. Bounded for any
    input: a name past NEAREST_LONGEST characters is matched up to case only, and at most
    NEAREST_COMPARED candidates are compared by spelling (the rest of the cost is a sort
    of the names)."""
    folded = word.casefold()
    near: list[tuple[int, str]] = []
    for candidate in candidates:
        if candidate == word:
            continue
        if candidate.casefold() == folded:
            return candidate
        if len(word) <= NEAREST_LONGEST and len(candidate) <= NEAREST_LONGEST:
            near.append((abs(len(candidate) - len(word)), candidate))
    if not near:
        return None
    half = NEAREST_COMPARED // 2
    ordered = sorted(candidate for _, candidate in near)
    at = bisect.bisect_left(ordered, word)
    near.sort(key=lambda pair: pair[0])  # stable: the first of equally near ones wins
    pool = [*ordered[max(0, at - half // 2) : at + half // 2], *(c for _, c in near[:half])]
    close = difflib.get_close_matches(word, list(dict.fromkeys(pool)), n=1, cutoff=cutoff)
    return close[0] if close else None


def _gutter_width(diag: Diagnostic) -> int:
    spans = [diag.span] if diag.span else []
    spans.extend(label.span for label in diag.labels)
    return max((len(str(span.line)) for span in spans), default=1)


EXCERPT = 120
"""The most characters of a source line an excerpt shows; a longer line is cut to a
window around the span, each cut end marked `...`."""


def _excerpt(span: Span, message: str, primary: bool) -> list[str]:
    line, col = span.source.line_col(span.start)
    text = span.source.line_text(line).replace("\t", " ")
    end_line, end_col = span.source.line_col(max(span.start, span.end))
    width = max(1, (end_col - col) if end_line == line else len(text) - col + 1)
    if len(text) > EXCERPT:
        first = max(0, min(col - 1 - EXCERPT // 4, len(text) - EXCERPT))
        head = "..." if first > 0 else ""
        tail = "..." if first + EXCERPT < len(text) else ""
        width = min(width, first + EXCERPT - (col - 1))
        col = col - first + len(head)
        text = head + text[first : first + EXCERPT] + tail
    marker = ("^" if primary else "-") * max(1, width)
    pad = " " * len(str(line))
    arrow = "-->" if primary else ":::"
    suffix = f" {message}" if message else ""
    return [
        f"{pad}{arrow} {span.location()}",
        f"{pad} |",
        f"{line} | {text}",
        f"{pad} | {' ' * (col - 1)}{marker}{suffix}",
    ]


MAX_REPORTED = 20
"""The most diagnostics one error report shows (a mistake in a loop over 1000 ranks is
one mistake; the count of the rest follows)."""


@dataclass
class PipelangError(Exception):
    """Raised with every diagnostic a stage found; the CLI prints them all, sorted."""

    diagnostics: list[Diagnostic] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.diagnostics = sorted(self.diagnostics, key=Diagnostic.sort_key)
        super().__init__(self.render())

    def render(self) -> str:
        """The first `MAX_REPORTED` diagnostics, and how many more there are."""
        shown = [d.render() for d in self.diagnostics[:MAX_REPORTED]]
        hidden = len(self.diagnostics) - len(shown)
        if hidden:
            shown.append(
                f"error: {hidden} more error{'s' * (hidden > 1)} not shown (the first "
                f"{MAX_REPORTED} are above; fix those first)"
            )
        return "\n\n".join(shown)

    def to_json(self) -> str:
        """`{"ok": false, "diagnostics": [...]}`: what `--json` / `--format json` print;
        like the text, the first `MAX_REPORTED`, and `"not_shown"` counts the rest."""
        doc: dict[str, object] = {
            "ok": False,
            "diagnostics": [d.to_json() for d in self.diagnostics[:MAX_REPORTED]],
        }
        if len(self.diagnostics) > MAX_REPORTED:
            doc["not_shown"] = len(self.diagnostics) - MAX_REPORTED
        return json.dumps(doc, indent=2)


class InternalError(Exception):
    """A bug in pipelang itself, not in the user's schedule."""


def fail(code: str, message: str, span: Span | None = None, **kwargs: object) -> PipelangError:
    """Build the error for one diagnostic; `raise fail(...)` reads as a guard clause."""
    return PipelangError([Diagnostic(code, message, span, **kwargs)])  # type: ignore[arg-type]


SHOWN = 3
"""How many items a merged diagnostic names before `and N more`."""


def label(span: Span | None, message: str) -> tuple[Label, ...]:
    """A label at `span`, or none for something without a source position."""
    return () if span is None else (Label(span, message),)


def listing(items: Sequence[object]) -> str:
    """`A`, `B`, `C` and 4 more."""
    names = ", ".join(f"`{item}`" for item in items[:SHOWN])
    return names if len(items) <= SHOWN else f"{names} and {len(items) - SHOWN} more"


def merged(
    code: str,
    span: Span | None,
    details: Sequence[str],
    names: Sequence[object],
    many: str,
    labels: tuple[Label, ...] = (),
    help: str | None = None,
) -> Diagnostic:
    """One diagnostic for a mistake made once or, by a loop, many times: its detail when
    once, else `N {many}: A, B, C and K more` with the first details as notes."""
    if len(details) == 1:
        return Diagnostic(code, details[0], span, labels, help=help)
    message = f"{len(details)} {many}: {listing(names)}"
    return Diagnostic(code, message, span, labels, notes=tuple(details[:SHOWN]), help=help)
