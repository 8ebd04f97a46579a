"""`pipelang import-torch FILE.csv`: torch's CSV schedule as a checked `.pipe` program."""

from __future__ import annotations

import argparse
import re

from pipelang.cli.args import UsageError, path, write_output
from pipelang.import_torch import check_pipe, import_torch

HELP = "read torch's CSV schedule into a checked .pipe program"


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "csv",
        metavar="FILE.csv",
        type=path,
        help="torch's compute-only CSV (schedule._dump_csv(FILE, 'compute_only'))",
    )
    parser.add_argument(
        "-o",
        dest="out",
        type=path,
        metavar="OUT.pipe",
        help="write the .pipe file here instead of standard output",
    )
    parser.add_argument("--name", help="the schedule's name (default: from the file name)")


def run(args: argparse.Namespace) -> int:
    if args.name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.name):
        raise UsageError(f"`--name {args.name}` is not an identifier")
    imported = import_torch(args.csv, args.name)
    text = imported.text
    if args.out is None:  # errors point at the CSV's cells and rows: the text is not shown
        check_pipe(text, f"<import-torch {args.csv.name}>", imported)
        print(text, end="")
        return 0
    # Written before the check, so that a schedule that fails it can be read and fixed;
    # its errors point at the CSV all the same: the user wrote the CSV, not the .pipe.
    write_output(args.out, text)
    program = check_pipe(text, str(args.out), imported).need_program()
    print(
        f"wrote {args.out}: {program.num_ranks} ranks, {program.num_stages} stages, "
        f"{program.num_microbatches} micro-batches; check ok"
    )
    return 0
