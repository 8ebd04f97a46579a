"""`pipelang import-torch`: torch's compute-only CSV schedule into a checked `.pipe` file.

torch.distributed.pipelining writes a schedule as CSV, one row per rank, one action per
cell: `<stage><kind><micro-batch>` with kind F (forward), I (input-gradient backward),
W (weight gradient) or B (full backward); stage ids are global and a stage lives on one
rank. Empty cells are idle steps. This module reads such a file, infers the stages, the
stage -> rank placement, the micro-batches and whether W is split, and writes a `.pipe`
program whose `order rank` lists every rank's ops as torch gives them. The program is
then compiled and validated like any other, so a schedule a user has in torch can be
checked, simulated and drawn.

    0F0,0F1,0B0,0B1           schedule imported() {
    ,1F0,1B0,1F1,1B1     =>       pipeline main: stage s in 0..2 -> rank s
                                  ...
                                  order rank r { if r == 0 { F(mb=0, stage=0) ... } ... }

Communication and bookkeeping cells (SEND_F, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD) are
dropped: pipelang inserts its own transfers and gradient sync. An overlapped pair
`(0F1;1B0)OVERLAP_F_B` becomes `F(mb=1, stage=0) & B(mb=0, stage=1)`; a full backward
`B` in a CSV that also splits backwards into I and W becomes `BW`.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from pipelang import ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import Diagnostic, PipelangError, clip, fail
from pipelang.parser import keywords, parse_text, read_source
from pipelang.source import SourceFile, Span, one_line

_ID = r"([0-9]{1,9})"  # a stage or micro-batch: ASCII digits, and few (any id past the
# cell count leaves a hole, found in `_no_holes` without counting up to it)
_COMPUTE = re.compile(rf"{_ID}([FIBW]){_ID}")
_OVERLAP = re.compile(rf"\({_ID}(F){_ID};{_ID}([IB]){_ID}\)OVERLAP_F_B")
_DROPPED = re.compile(
    rf"{_ID}(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)([0-9]{{0,9}})"
)
_OPS_PER_LINE = 5


@dataclass(frozen=True)
class Cell:
    """One compute action of the CSV: torch's letter, stage, micro-batch, where it is."""

    kind: str
    stage: int
    mb: int
    span: Span
    fused: bool = False
    """Started together with the cell before it (the backward of an OVERLAP_F_B pair)."""


@dataclass(frozen=True)
class TorchSchedule:
    """What the CSV says: each rank's compute cells in order, and how many were dropped."""

    source: SourceFile
    ranks: tuple[tuple[Cell, ...], ...]
    lines: tuple[Span, ...]
    """Where each rank's row is, for diagnostics about a whole row."""
    dropped: int


def read_torch_csv(source: SourceFile) -> TorchSchedule:
    """Parse the cells of a torch CSV; a cell that is not an action is E0007."""
    ranks: list[tuple[Cell, ...]] = []
    lines: list[Span] = []
    dropped = 0
    offset = 0
    for line in source.text.splitlines(keepends=True):
        row: list[Cell] = []
        for start, text in _cells(line.rstrip("\r\n")):
            span = Span(source, offset + start, offset + start + len(text))
            cell = text.strip()
            if not cell:
                continue
            match = _COMPUTE.fullmatch(cell)
            pair = _OVERLAP.fullmatch(cell)
            if match:
                row.append(Cell(match[2], int(match[1]), int(match[3]), span))
            elif pair:
                row.append(Cell(pair[2], int(pair[1]), int(pair[3]), span))
                row.append(Cell(pair[5], int(pair[4]), int(pair[6]), span, fused=True))
            elif _DROPPED.fullmatch(cell):
                dropped += 1
            else:
                raise _bad_cell(cell, span)
        lines.append(Span(source, offset, offset + len(line.rstrip("\r\n"))))
        offset += len(line)
        ranks.append(tuple(row))
    while ranks and not ranks[-1]:
        ranks.pop()
    if not ranks:
        raise fail(
            "E0007",
            f"`{source.path}` holds no actions",
            help="export one with torch's `schedule._dump_csv(FILE, 'compute_only')`",
        )
    return TorchSchedule(source, tuple(ranks), tuple(lines[: len(ranks)]), dropped)


def _cells(line: str) -> list[tuple[int, str]]:
    """(column offset, text) of each comma-separated cell; torch never quotes its cells."""
    cells, start = [], 0
    for text in line.split(","):
        cells.append((start, text))
        start += len(text) + 1
    return cells


def _bad_cell(cell: str, span: Span) -> Exception:
    return fail(
        "E0007",
        f"`{cell}` is not a torch action",
        span,
        help="cells look like `2F0` (stage 2, forward, micro-batch 0) or "
        "`(2F0;5B1)OVERLAP_F_B`; kinds are F, I (input grad), W (weight grad), "
        "B (full backward)",
    )


@dataclass(frozen=True)
class Layout:
    """What the CSV implies: stage -> rank, micro-batch count, whether W is split."""

    placement: tuple[int, ...]
    num_microbatches: int
    split_w: bool


def infer_layout(schedule: TorchSchedule) -> Layout:
    """Stages and micro-batches numbered without holes, each stage on one rank."""
    cells = [c for row in schedule.ranks for c in row]
    home: dict[int, tuple[int, Cell]] = {}
    for rank, row in enumerate(schedule.ranks):
        for cell in row:
            first = home.setdefault(cell.stage, (rank, cell))
            if first[0] != rank:
                raise fail(
                    "E0205",
                    f"stage {cell.stage} runs on ranks {first[0]} and {rank}",
                    cell.span,
                    notes=(f"first seen on rank {first[0]} at {first[1].span.location()}",),
                    help="torch's stage ids are global: each stage lives on one rank",
                )
    _no_holes("stage", "E0205", {c.stage: c for c in cells})
    _no_holes("micro-batch", "E0206", {c.mb: c for c in cells})
    idle = [r for r, row in enumerate(schedule.ranks) if not row]
    if idle:
        raise fail(
            "E0205",
            f"rank {idle[0]} runs no compute action",
            schedule.lines[idle[0]],
            help="every rank must hold a stage; rows are ranks 0, 1, ...",
        )
    split = [c for c in cells if c.kind in "IW"]
    placement = tuple(home[s][0] for s in range(len(home)))
    return Layout(placement, 1 + max(c.mb for c in cells), bool(split))


def _no_holes(what: str, code: str, seen: dict[int, Cell]) -> None:
    """`seen` maps each id to a cell using it; ids must be 0..max without holes."""
    top = max(seen)
    if top >= len(seen):  # a hole; the first is at most len(seen)
        first = next(i for i in range(len(seen) + 1) if i not in seen)
        raise fail(
            code,
            f"{what} {first} never appears, but {what} {top} does",
            seen[top].span,
            help=f"{what.replace('batch', 'batche')}s must be numbered 0, 1, ... without holes",
        )


def to_pipe(schedule: TorchSchedule, name: str, origin: str) -> Imported:
    """The `.pipe` text for a torch schedule (see the module docstring)."""
    layout = infer_layout(schedule)
    ranks, stages = len(schedule.ranks), len(layout.placement)
    rank_expr, style = placement_expr(layout.placement, ranks)
    # A full backward in a split schedule is `BW`: its B and W as one action.
    letters = {"F": "F", "I": "B", "B": "BW" if layout.split_w else "B", "W": "W"}
    lines = [
        f"# Imported from torch's CSV schedule `{one_line(origin)}`: {_count(ranks, 'rank')}, "
        f"{_count(stages, 'stage')}, {_count(layout.num_microbatches, 'micro-batch')}.",
        "#",
        "# Written by `pipelang import-torch`; each rank's order is its row of the CSV.",
        f"# Placement: {style}.",
    ]
    if layout.split_w:
        lines.append(
            "# The backward is split: torch's I (input gradient) is B here, its B (full "
            "backward) BW."
        )
    if schedule.dropped:
        lines.append(
            f"# {schedule.dropped} communication / bookkeeping cells were dropped; "
            "pipelang inserts its own."
        )
    lines += [
        f"schedule {name}() {{",
        *(["    ops F, B, W"] if layout.split_w else []),
        f"    pipeline main: stage s in 0..{stages} -> rank {rank_expr}",
        f"    microbatches 0..{layout.num_microbatches} -> main",
        "    order rank r {",
    ]
    origins: list[tuple[int, int, Span]] = []
    blocks: list[tuple[int, int, Span]] = []
    size = sum(len(line) + 1 for line in lines)  # the text's length so far, newlines too
    for rank, row in enumerate(schedule.ranks):
        head = "if" if rank == 0 else "} else if"
        lines.append(f"        {head} r == {rank} {{")
        blocks.append((size, size, schedule.lines[rank]))
        size += len(lines[-1]) + 1
        ops: list[list[tuple[str, Span]]] = []  # statements: (op text, its cell) each
        for c in row:
            op = (f"{letters[c.kind]}(mb={c.mb}, stage={c.stage})", c.span)
            if c.fused and ops:
                ops[-1].append(op)
            else:
                ops.append([op])
        for i in range(0, len(ops), _OPS_PER_LINE):
            lines.append(_statements(ops[i : i + _OPS_PER_LINE], size, origins))
            size += len(lines[-1]) + 1
        blocks[-1] = (blocks[-1][0], size, blocks[-1][2])
    lines += ["        }", "    }", "}", ""]
    return Imported("\n".join(lines), tuple(origins), tuple(blocks))


@dataclass(frozen=True)
class Imported:
    """The `.pipe` text `to_pipe` writes, and where each op in it came from."""

    text: str
    origins: tuple[tuple[int, int, Span], ...]
    """(start, end) of an op's text, and the CSV cell it came from, in text order."""
    rows: tuple[tuple[int, int, Span], ...] = ()
    """(start, end) of each rank's block of ops, and the CSV row it came from (rank r's
    is row r + 1)."""

    def cell_at(self, offset: int) -> Span | None:
        """The CSV cell of the op whose text holds `offset`, None outside every op."""
        return _holding(self.origins, offset)

    def csv_span(self, offset: int, message: str) -> Span | None:
        """Where in the CSV the text at `offset` came from: the op's cell, else the row
        of the rank whose block holds it, else the row of the rank the message is about
        (`rank 1 never runs ...` points at the schedule's order: at the row that lacks
        the op); None when none is known."""
        found = self.cell_at(offset) or _holding(self.rows, offset)
        about = _RANK.match(message)
        if found is None and about is not None and int(about[1]) < len(self.rows):
            found = self.rows[int(about[1])][2]
        return found


_RANK = re.compile(r"rank ([0-9]{1,9})\b")
"""A message about one rank, as validate words it."""


def _holding(spans: tuple[tuple[int, int, Span], ...], offset: int) -> Span | None:
    """The span paired with the (start, end) that holds `offset`, of sorted ones."""
    index = bisect.bisect_right(spans, (offset, math.inf)) - 1
    if index >= 0 and spans[index][0] <= offset < spans[index][1]:
        return spans[index][2]
    return None


def _statements(
    statements: list[list[tuple[str, Span]]], start: int, origins: list[tuple[int, int, Span]]
) -> str:
    """One line of op statements (ops fused with `&`) that starts at offset `start` of
    the text; each op's place and cell go to `origins`."""
    line = "            "
    for i, statement in enumerate(statements):
        for j, (text, cell) in enumerate(statement):
            line += " & " if j else " " if i else ""
            origins.append((start + len(line), start + len(line) + len(text), cell))
            line += text
    return line


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("h") else "s")


def placement_expr(placement: tuple[int, ...], ranks: int) -> tuple[str, str]:
    """A readable `rank` expression over `s` for the placement, and its style's name."""
    stages = len(placement)
    if placement == tuple(range(stages)):
        return "s", "stage s on rank s"
    if placement == tuple(s % ranks for s in range(stages)):
        return f"s % {ranks}", f"loop, stage s on rank s % {ranks}"
    if stages == 2 * ranks and placement == tuple(min(s, 2 * ranks - 1 - s) for s in range(stages)):
        return (
            f"if s < {ranks} then s else {2 * ranks - 1} - s",
            "V, rank r holds stages r and 2D-1-r",
        )
    if placement == tuple(stages - 1 - s for s in range(stages)):
        return f"{stages - 1} - s", "reversed, stage s on rank D-1-s"
    expr = str(placement[-1])
    for s in range(stages - 2, -1, -1):
        expr = f"if s == {s} then {placement[s]} else {expr}"
    return expr, "as listed"


def schedule_name(path: Path) -> str:
    """An identifier made from the file's name: `zbv-4x8.csv` -> `zbv_4x8`."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", path.stem)
    if name in keywords() or not re.match(r"[A-Za-z_]", name):
        return f"imported_{name}"
    return name


def import_torch(path: Path, name: str | None = None) -> Imported:
    """The `.pipe` text for the torch CSV at `path` (not yet checked: see `check_pipe`)."""
    if name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise fail("usage", f"`{clip(name)}` is not an identifier: a schedule's name")
    schedule = read_torch_csv(read_source(path))
    return to_pipe(schedule, name or schedule_name(path), path.name)


def check_pipe(text: str, display: str, imported: Imported | None = None) -> Compilation:
    """Parse and validate generated `.pipe` text (raises PipelangError with diagnostics).
    With `imported` (what `to_pipe` made `text` from), a diagnostic that points at an op
    points at the CSV cell it came from instead: the text itself is never shown."""
    source = SourceFile.of(display, text)
    schedule = next(i for i in parse_text(source) if isinstance(i, ast.Schedule))
    try:
        return run_passes(ast.File(source, schedule, {}), Options(), "validate")
    except PipelangError as err:
        if imported is None:
            raise
        raise PipelangError([_in_csv(d, source, imported) for d in err.diagnostics]) from None


def _in_csv(diagnostic: Diagnostic, source: SourceFile, imported: Imported) -> Diagnostic:
    """`diagnostic` with its spans in the generated text moved to the CSV: an op's to its
    cell, anything else to its rank's row (`Imported.csv_span`); a span with no place in
    the CSV is dropped, and its label with it."""

    def moved(span: Span | None, message: str) -> Span | None:
        if span is None or span.source is not source:
            return span
        return imported.csv_span(span.start, message)

    labels = tuple(
        replace(label, span=where)
        for label in diagnostic.labels
        if (where := moved(label.span, label.message)) is not None
    )
    return replace(diagnostic, span=moved(diagnostic.span, diagnostic.message), labels=labels)
