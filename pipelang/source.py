"""Source text and positions: every diagnostic points back into a `SourceFile`."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def one_line(text: str) -> str:
    """`text` as it may go into a line of a generated file (a comment of a written `.pipe`
    or rank program): every character that is not printable, line breaks among them, is
    written as its Python escape, so text from a user's input can never end the line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


@dataclass(frozen=True, slots=True, eq=False)
class SourceFile:
    """The text of one `.pipe` file and the name to print for it.

    Compared and hashed by identity: a file is read once, and spans that point into it
    must stay cheap to hash.
    """

    path: str
    text: str
    _line_starts: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @staticmethod
    def of(path: str, text: str) -> SourceFile:
        """The file as the compiler reads it: a UTF-8 byte-order mark dropped, and CRLF
        and CR-only line endings made `\n`, so that lines and columns are the ones an
        editor shows whatever the file's endings."""
        text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
        starts = [0]
        starts.extend(i + 1 for i, ch in enumerate(text) if ch == "\n")
        return SourceFile(path, text, tuple(starts))

    def line_col(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset."""
        index = bisect.bisect_right(self._line_starts, offset) - 1
        return index + 1, offset - self._line_starts[index] + 1

    def line_start(self, line: int) -> int:
        """The offset of a 1-based line's first character."""
        return self._line_starts[min(max(line, 1), len(self._line_starts)) - 1]

    def line_text(self, line: int) -> str:
        """The text of a 1-based line, without its newline."""
        if not 1 <= line <= len(self._line_starts):
            return ""
        start = self._line_starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start : end if end >= 0 else len(self.text)]


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open character range `[start, end)` in one source file."""

    source: SourceFile
    start: int
    end: int

    @property
    def line(self) -> int:
        return self.source.line_col(self.start)[0]

    @property
    def column(self) -> int:
        return self.source.line_col(self.start)[1]

    def location(self) -> str:
        """`file:line:col`, as editors expect."""
        line, col = self.source.line_col(self.start)
        return f"{self.source.path}:{line}:{col}"

    def sort_key(self) -> tuple[str, int]:
        return (self.source.path, self.start)

    def __repr__(self) -> str:
        return f"Span({self.location()})"
