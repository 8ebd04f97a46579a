"""`pipelang check`: parse, bind parameters, validate; one line (or JSON) when it is fine."""

from __future__ import annotations

import argparse
import json

from pipelang.cli.args import (
    add_max_activations,
    add_schedule_arguments,
    add_shard_arguments,
    compile_args,
    describe,
)
from pipelang.compiler import SCHEDULE_DONE

HELP = "check a schedule: parse, bind parameters, validate the order"


def setup(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    add_max_activations(parser)
    add_shard_arguments(parser)
    parser.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="json prints diagnostics (or the summary) as one JSON object",
    )


def run(args: argparse.Namespace) -> int:
    program = compile_args(args, SCHEDULE_DONE).need_program()
    if args.format == "json":
        summary = {
            "ok": True,
            "schedule": program.name,
            "params": dict(program.params),
            "ranks": program.num_ranks,
            "stages": program.num_stages,
            "microbatches": program.num_microbatches,
            "diagnostics": [],
        }
        print(json.dumps(summary))
    else:
        print(f"ok: {describe(program)}")
    return 0
