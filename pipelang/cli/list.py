"""`pipelang list`: the standard-library schedules, their parameters and one line each."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from pipelang import api
from pipelang.progress import console

HELP = "show the standard-library schedules and their parameters"


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("table", "json"), default="table")


def run(args: argparse.Namespace) -> int:
    rows = []
    for name in api.stdlib_names():
        file = api.load_file(name)
        params = ", ".join(
            p.name + (f"={_source(p.default)}" if p.default is not None else "")
            for p in file.schedule.params
        )
        rows.append((name, params, _summary(file.source.text)))
    if args.format == "json":
        print(json.dumps([{"name": n, "params": p, "summary": s} for n, p, s in rows], indent=1))
        return 0
    table = Table(title="pipelang standard library", show_lines=False)
    for column in ("schedule", "parameters", "what it is"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console().print(table)
    return 0


def _source(node: object) -> str:
    span = node.span  # type: ignore[attr-defined]
    return str(span.source.text[span.start : span.end])


def _summary(text: str) -> str:
    """The first comment line of a stdlib file is its one-line description."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""
