"""Reading what users give: one reader per kind of value and file, shared by every command.

Every number a user gives goes through `whole_number` or `number` here, so that the
limits are the same wherever it is read (docs/language.md, "Limits"): whole numbers are
ASCII digits, at most 18 of them; other numbers are finite and inside the range their
caller names. Every text file (a `--lengths` or `--sequences` list, a profile, a
topology, a torch CSV, a `.pipe` file) is read by `read_text`: strict UTF-8, no NUL, at
most `MAX_FILE_BYTES` (a `.pipe` file 1 MiB); `SourceFile.of` then drops a byte-order
mark and evens out line endings. Anything else is one error naming the file.
JSON is read by `read_json`, which refuses what Python's own reader would turn into a
traceback (deep nesting, integers past 18 digits, NaN and Infinity).

Problems are `ReadError`s carrying a message and, for a file, the position; each caller
turns one into its own diagnostic (a code and a span) or usage error.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from pipelang.diagnostics import PipelangError, fail
from pipelang.evaluate import MAX_DIGITS
from pipelang.source import SourceFile, Span

MAX_FILE_BYTES = 64 * 2**20
"""The largest input file read (the 10 s / 1 GiB promise is for files under 1 MiB)."""
MAX_BYTES = 2.0**60
"""The largest size read (1 EiB): a device's memory (a topology), a tensor, a layer's
bytes (a profile)."""

_WHOLE = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}")


class ReadError(ValueError):
    """A value or file that cannot be read; `offset` is where in the file, when known;
    `reason`, for a file: `size`, `encoding`, `binary` or `os`, so that a caller with
    messages of its own (the `.pipe` reader) can say it its way."""

    def __init__(self, message: str, offset: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.offset = offset
        self.reason = reason


def whole_number(text: str, least: int = 0, most: int | None = None, what: str = "") -> int:
    """`text` as a whole number in `least..most`: ASCII digits only (no sign, no `²`),
    at most `MAX_DIGITS` of them."""
    name = f"{what} " if what else ""
    if not _WHOLE.fullmatch(text):
        shown = text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"
        if text.isdigit() and len(text) > MAX_DIGITS:
            raise ReadError(f"{name}`{shown}` has more than {MAX_DIGITS} digits")
        raise ReadError(f"{name}expected a whole number, not `{shown}`")
    value = int(text)
    if value < least or (most is not None and value > most):
        bound = f"at least {least}" if most is None else f"{least} to {most:,}"
        raise ReadError(f"{name}must be {bound}, not {value:,}")
    return value


def number(value: float, what: str, least: float = 0.0, most: float = 1e15) -> float:
    """`value` if it is finite and in `least..most`; `what` names it in the error."""
    if not (math.isfinite(value) and least <= value <= most):
        raise ReadError(f"{what} must be between {least:g} and {most:g}, not {value:g}")
    return value


def read_text(path: Path, limit: int = MAX_FILE_BYTES) -> str:
    """The text of a user's file, strict UTF-8 (`SourceFile.of` drops a byte-order mark
    and evens out line endings), read no further than `limit` bytes. A missing,
    unreadable, oversized or binary file is a ReadError. Every text file goes through
    here, `.pipe` files too (`parser.read_source`, with its own limit)."""
    try:
        with path.open("rb") as file:
            data = file.read(limit + 1)
    except OSError as err:
        raise ReadError(str(err.strerror or err), reason="os") from None
    if len(data) > limit:
        raise ReadError(f"it is larger than {limit // 2**20} MiB", reason="size")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        byte = f"byte {err.start} is 0x{data[err.start]:02x}"
        raise ReadError(f"it is not UTF-8 text ({byte})", err.start, "encoding") from None
    if "\0" in text:
        raise ReadError("it is not text (it holds a NUL byte)", reason="binary")
    return text


def read_source(path: Path, code: str) -> SourceFile:
    """`read_text` as a SourceFile for diagnostics; an unreadable file is `code`."""
    try:
        return SourceFile.of(str(path), read_text(path))
    except ReadError as err:
        raise fail(code, f"cannot read `{path}`: {err}") from None


def read_json(text: str) -> object:
    """JSON text as Python values; a ReadError (with the offset) for anything that is
    not strict JSON within the limits."""

    def refuse_constant(name: str) -> object:
        raise ReadError(f"`{name}` is not a JSON number")

    def bounded_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise ReadError(f"an integer of more than {MAX_DIGITS} digits")
        return int(digits)

    try:
        return json.loads(text, parse_constant=refuse_constant, parse_int=bounded_int)
    except json.JSONDecodeError as err:
        raise ReadError(f"it is not JSON: {err.msg}", err.pos) from None
    except RecursionError:
        raise ReadError("it nests arrays and objects too deep") from None


def file_error(code: str, source: SourceFile, err: ReadError, line: int = 0) -> PipelangError:
    """`err` as diagnostic `code`, pointing into `source` at its offset, or at 1-based
    `line` when it has none (nowhere when neither is known)."""
    span = None
    if err.offset is not None:
        span = Span(source, err.offset, min(err.offset + 1, len(source.text)))
    elif line:
        start = source.line_start(line)
        span = Span(source, start, start + max(1, len(source.line_text(line))))
    return fail(code, str(err), span)


MAX_COUNT = 10**15
"""The largest count a file of whole numbers holds (a length in tokens, samples)."""


def read_number_rows(path: Path, code: str, expected: str, most: int, what: str) -> list[list[int]]:
    """The rows of a file of whole numbers from 1 to `MAX_COUNT`, 1 to `most` a line (`#`
    starts a comment, blank lines are skipped). An unreadable file is E0003; a malformed
    line, or a file that lists nothing, is `code` at its line."""
    source = read_source(path, "E0003")
    rows = []
    for number, line in enumerate(source.text.split("\n"), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            if len(words) > most:
                raise ReadError(f"expected {expected}, found {len(words)} numbers")
            rows.append([whole_number(w, 1, MAX_COUNT) for w in words])
        except ReadError as err:
            raise file_error(
                code, source, ReadError(f"expected {expected}: {err}"), number
            ) from None
    if not rows:
        raise fail(code, f"`{path}` lists no {what}")
    return rows
