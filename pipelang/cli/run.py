"""`pipelang run`: train a model with the schedule (docs/runtime.md)."""

from __future__ import annotations

import argparse
import sys

from pipelang.cli.args import (
    add_run_arguments,
    add_schedule_arguments,
    compile_args,
    config_from_args,
)

HELP = "train a model with the schedule: one process per rank (gloo), or local"


def setup(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    add_run_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pipelang.backends.checkpoint_read import CheckpointError
    from pipelang.backends.termination import EXIT_STATUS, Terminated, passing_sigterm

    with passing_sigterm(None):  # from here on SIGTERM is a message and exit 143
        try:
            from pipelang.backends.launch import run_program
            from pipelang.compiler import stream_program
            from pipelang.planner.write import read_plan

            program = compile_args(args).need_program()
            config = config_from_args(args)
            # what the ranks run comes from the compiler: their stream program, checked
            streams = lambda: stream_program(program, config.dp)  # noqa: E731
            return run_program(program, config, streams, read_plan(program.source))
        except CheckpointError as err:  # a checkpoint that cannot be read: exit 1, one line
            print(f"pipelang run: error: {err}", file=sys.stderr)
            return 1
        except Terminated:  # before run_program took it over: compiling, reading options
            print(
                "terminated (SIGTERM) during set-up, before any step: nothing was saved",
                file=sys.stderr,
            )
            return EXIT_STATUS
