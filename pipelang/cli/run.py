"""`pipelang run`: train a model with the schedule (docs/runtime.md)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from pipelang.cli.args import UsageError, add_schedule_arguments, compile_args, path
from pipelang.cli.config_file import write_effective_config
from pipelang.cli.run_options import add_run_arguments, config_from_args

if TYPE_CHECKING:
    from pipelang.ir import Program

HELP = "train a model with the schedule: one process per rank (gloo), or local"


def setup(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser, optional=True)
    add_run_arguments(parser)
    parser.add_argument(
        "--config",
        type=path,
        metavar="FILE.toml",
        help="take the options from a TOML file: each option a key named as its flag "
        '(`steps = 100`, `lr-schedule = "cosine"`, a flag `check = true`), `schedule = '
        "\"1f1b\"` and a [params] table; the command line's options override the file's. "
        "With --save DIR, the run writes DIR/config.toml, which runs it again",
    )


def run(args: argparse.Namespace) -> int:
    from pipelang.backends.termination import EXIT_STATUS, Terminated, passing_sigterm

    with passing_sigterm(None):  # from here on SIGTERM is a message and exit 143
        try:
            if args.sched is None:
                raise UsageError(
                    "give the schedule: SCHED (a .pipe file or a stdlib name), or "
                    "`schedule = ...` in the --config file"
                )
            program = compile_args(args).need_program()
            _start_rank_server(args.backend)
            return _run(args, program)
        except Terminated:  # before run_program took it over: compiling, reading options
            print(
                "terminated (SIGTERM) during set-up, before any step: nothing was saved",
                file=sys.stderr,
            )
            return EXIT_STATUS


def _start_rank_server(backend: str) -> None:
    """Where the ranks are processes this command starts, start the forkserver they fork
    from now, before this process imports torch: the two imports overlap (seconds)."""
    from pipelang.backends.backend import BACKENDS
    from pipelang.backends.torchrun_env import under_torchrun

    if BACKENDS[backend].processes and not under_torchrun():
        from pipelang.backends.rank_server import forkserver

        forkserver()


def _run(args: argparse.Namespace, program: Program) -> int:
    from pipelang.backends.checkpoint_read import CheckpointError
    from pipelang.backends.launch import run_program
    from pipelang.compiler import stream_program
    from pipelang.planner.write import read_plan

    try:
        config = config_from_args(args)
        write_effective_config(args, _parser())
        # what the ranks run comes from the compiler: their stream program, checked
        streams = lambda: stream_program(program, config.dp)  # noqa: E731
        return run_program(program, config, streams, read_plan(program.source))
    except CheckpointError as err:  # a checkpoint that cannot be read: exit 1, one line
        print(f"pipelang run: error: {err}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    """`pipelang run`'s options alone (what its written config lists)."""
    parser = argparse.ArgumentParser(prog="pipelang run")
    setup(parser)
    return parser
