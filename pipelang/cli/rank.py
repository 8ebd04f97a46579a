"""The command lines of a compiled program: a generated `rank{r}.py` started by hand, and
`python -m pipelang.backends SCHEDULE.json` (both take the options of `pipelang run`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipelang.cli.args import UsageError, path
from pipelang.cli.run_options import add_run_arguments, config_from_args
from pipelang.diagnostics import PipelangError
from pipelang.passes.validate.lowered import read_lowered

if TYPE_CHECKING:
    from pipelang.backends.config import RunConfig


def rank_file_main(rank: int, file: str) -> int:
    """The `__main__` of a generated `rank{r}.py`: its folder holds schedule.json; the
    environment gives WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun does)."""
    from pipelang.backends.torchrun_rank import run_rank_file
    from pipelang.planner.write import read_plan

    parser = argparse.ArgumentParser(
        prog=Path(file).name,
        description=f"Rank {rank} of a compiled pipelang schedule. Start every rank's file at "
        "once with WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.",
    )
    add_run_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks")
    config = _config(parser, parser.parse_args())
    try:
        program = read_lowered(Path(file).parent / "schedule.json")
    except PipelangError as err:
        print(err.render(), file=sys.stderr)
        return 1
    return run_rank_file(rank, file, program, config, read_plan(program.source))


def compiled_main() -> int:
    """`python -m pipelang.backends SCHEDULE.json [run options]`: run what `pipelang
    compile -o DIR` wrote (DIR/schedule.json)."""
    from pipelang.backends.launch import run_program
    from pipelang.compiler import stream_program
    from pipelang.planner.write import read_plan

    parser = argparse.ArgumentParser(
        prog="python -m pipelang.backends", description="Run a compiled pipelang program."
    )
    parser.add_argument("schedule", type=path, metavar="SCHEDULE.json")
    add_run_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks")
    args = parser.parse_args()
    config = _config(parser, args)
    try:
        program = read_lowered(args.schedule)
    except PipelangError as err:
        print(err.render(), file=sys.stderr)
        return 1
    streams = lambda: stream_program(program, config.dp)  # noqa: E731  the compiler's
    return run_program(program, config, streams, read_plan(program.source))


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RunConfig:
    """The run's configuration; a value that cannot be used exits 2, as argparse does."""
    try:
        return config_from_args(args)
    except UsageError as err:
        parser.error(str(err))
