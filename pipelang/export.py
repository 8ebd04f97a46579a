"""Per-rank compute orders in other formats: pipelang's JSON and torch's CSV."""

from __future__ import annotations

import csv
import io
import json

from pipelang.features import refusal
from pipelang.ir import Action, Kind, Program


class ExportError(ValueError):
    """The program cannot be written in the asked-for format."""


def to_json(program: Program) -> str:
    """`{"ranks": [{"rank": r, "ops": [{"op", "mb", "stage", "pipeline"}, ...]}, ...]}`.

    An asynchronous schedule's weight updates are in the list too, as
    `{"op": "U", "update": k, "stage", "pipeline"}` (the copy's k-th update, from 0), and
    evictions as `{"op": "E", "mb", "stage", "pipeline", "to": p}` and `{"op": "L", ...}`
    (the partner's holds are the compiler's, and left out); with sequence chunks every
    op has its `"chunk"`. An op that starts together
    with the one before it (the W of a fused `BW`, either op of an overlapped `F & B`
    after the first) has `"fused": true`: the order replays exactly from this. With
    micro-batches of different shapes, `"shapes"` lists `{"samples", "length"}` of each.

    One op a line: as readable as an indented document, and written by json's C encoder
    (an indented dump goes through the pure-Python one: 20 s for 500,000 ops)."""
    kept = (Kind.U, Kind.E, Kind.L)
    ranks = []
    for r, actions in enumerate(program.ranks):
        ops = ",\n   ".join(
            json.dumps(_json_op(a)) for a in actions if a.kind.is_compute or a.kind in kept
        )
        ranks.append(f'  {{"rank": {r}, "ops": [\n   {ops}\n  ]}}')
    doc: dict[str, object] = {"schedule": program.name, "params": dict(program.params)}
    if program.shapes is not None:  # micro-batches of different shapes, by micro-batch
        shapes = zip(program.shapes.samples, program.shapes.lengths, strict=True)
        doc["shapes"] = [{"samples": s, "length": n} for s, n in shapes]
    head = json.dumps(doc)
    return head[:-1] + ', "ranks": [\n' + ",\n".join(ranks) + "\n]}"


def _json_op(a: Action) -> dict[str, object]:
    if a.kind is Kind.U:
        return {"op": "U", "update": a.mb, "stage": a.stage, "pipeline": a.pipeline}
    op: dict[str, object] = {
        "op": a.kind.value,
        "mb": a.mb,
        "stage": a.stage,
        "pipeline": a.pipeline,
    }
    if a.chunk is not None:  # a schedule with sequence chunks
        op["chunk"] = a.chunk
    if a.kind is Kind.E:
        op["to"] = a.peer
    if a.fused:  # starts with the op before it: a fused `BW`, an overlapped `F & B`
        op["fused"] = True
    return op


def to_torch_csv(program: Program) -> str:
    """torch.distributed.pipelining's compute-only CSV: one row per rank, cells like `2F0`.

    torch's `B` is a full backward and `I` the input-gradient half, so pipelang's `B`
    becomes `I` when the schedule splits off `W`, and a B with its W fused to it (`BW`)
    is `B`. An overlapped pair `F3@0/main &B0@7/main` is the cell `(0F3;7B0)OVERLAP_F_B`.
    """
    refused = refusal(program, "torch-csv")
    if refused is not None:
        raise ExportError(refused)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in program.ranks:
        writer.writerow(_torch_cells(program, [a for a in actions if a.kind.is_compute]))
    return out.getvalue()


def _torch_cells(program: Program, actions: list[Action]) -> list[str]:
    """One rank's cells: a full backward (B, then its own W fused) is one `B` cell, and
    a forward with a backward fused to it one OVERLAP_F_B cell."""
    backward = "I" if Kind.W in program.kinds else "B"
    letters = {Kind.F: "F", Kind.B: backward, Kind.W: "W"}
    steps: list[list[str]] = []
    for i, a in enumerate(actions):
        whole = a.kind is Kind.W and i > 0 and actions[i - 1].kind is Kind.B
        if a.fused and whole and actions[i - 1].unfused() == a._replace(kind=Kind.B):
            steps[-1][-1] = f"{a.stage}B{a.mb}"
            continue
        cell = f"{a.stage}{letters[a.kind]}{a.mb}"
        if a.fused and steps:
            steps[-1].append(cell)
        else:
            steps.append([cell])
    cells = []
    for step in steps:
        if len(step) == 1:
            cells.append(step[0])
        elif len(step) == 2 and "F" in step[0] and "F" not in step[1]:
            cells.append(f"({step[0]};{step[1]})OVERLAP_F_B")
        else:
            raise ExportError(
                f"torch's CSV format has no action for `{' & '.join(step)}`; it overlaps "
                "only a forward with a backward"
            )
    return cells
