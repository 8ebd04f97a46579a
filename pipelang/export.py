"""Per-rank compute orders in other formats: pipelang's JSON and torch's CSV."""

from __future__ import annotations

import csv
import io
import json

from pipelang.ir import Kind, Program


class ExportError(ValueError):
    """The program cannot be written in the asked-for format."""


def to_json(program: Program) -> str:
    """`{"ranks": [{"rank": r, "ops": [{"op", "mb", "stage", "pipeline"}, ...]}, ...]}`."""
    ranks = [
        {
            "rank": r,
            "ops": [
                {"op": a.kind.value, "mb": a.mb, "stage": a.stage, "pipeline": a.pipeline}
                for a in actions
                if a.kind.is_compute
            ],
        }
        for r, actions in enumerate(program.ranks)
    ]
    return json.dumps(
        {"schedule": program.name, "params": dict(program.params), "ranks": ranks}, indent=1
    )


def to_torch_csv(program: Program) -> str:
    """torch.distributed.pipelining's compute-only CSV: one row per rank, cells like `2F0`.

    torch's `B` is a full backward and `I` the input-gradient half, so pipelang's `B`
    becomes `I` when the schedule splits off `W`.
    """
    if len(program.pipelines) != 1:
        raise ExportError(
            f"torch's CSV format holds one pipeline; `{program.name}` has "
            f"{len(program.pipelines)} (torch has no replicas or directions)"
        )
    if Kind.R in program.kinds:
        raise ExportError("torch's CSV format has no recompute op `R`")
    backward = "I" if Kind.W in program.kinds else "B"
    letters = {Kind.F: "F", Kind.B: backward, Kind.W: "W"}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in program.ranks:
        writer.writerow(f"{a.stage}{letters[a.kind]}{a.mb}" for a in actions if a.kind.is_compute)
    return out.getvalue()
