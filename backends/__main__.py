"""`python -m pipelang.backends SCHEDULE.json [run options]`: run a compiled program.

SCHEDULE.json is what `pipelang compile -o DIR` writes (DIR/schedule.json); the options
are those of `pipelang run`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelang.backends.launch import add_run_arguments, run_program
from pipelang.ir import Program


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelang.backends", description="Run a compiled pipelang program."
    )
    parser.add_argument("schedule", type=Path, metavar="SCHEDULE.json")
    add_run_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks")
    args = parser.parse_args()
    try:
        program = Program.from_json(args.schedule.read_text())
    except (OSError, ValueError, KeyError) as err:
        print(f"error: cannot read {args.schedule}: {err}", file=sys.stderr)
        return 2
    return run_program(program, args)


if __name__ == "__main__":
    sys.exit(main())
