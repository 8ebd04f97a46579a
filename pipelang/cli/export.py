"""`pipelang export`: each rank's compute ops as JSON, or the CSV torch's pipelining reads."""

from __future__ import annotations

import argparse

from pipelang.cli.args import UsageError, add_schedule_arguments, compile_args, path, write_output

HELP = "print each rank's compute ops as JSON or torch's CSV schedule format"


def setup(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--format",
        choices=("json", "torch-csv"),
        default="json",
        help="json: each rank's compute ops in order; torch-csv: the CSV "
        "that torch.distributed.pipelining's _load_csv reads",
    )
    parser.add_argument(
        "-o", dest="out", type=path, metavar="FILE", help="write to FILE instead of standard output"
    )


def run(args: argparse.Namespace) -> int:
    from pipelang.export import ExportError, to_json, to_torch_csv

    program = compile_args(args, "validate").need_program()
    try:
        text = to_json(program) if args.format == "json" else to_torch_csv(program)
    except ExportError as err:
        raise UsageError(str(err)) from None
    if args.out:
        write_output(args.out, text)
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0
