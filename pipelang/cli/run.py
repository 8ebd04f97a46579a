"""`pipelang run`: train a model with the schedule (docs/runtime.md)."""

from __future__ import annotations

import argparse

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
    from pipelang.backends.launch import run_program

    return run_program(compile_args(args).need_program(), config_from_args(args))
