"""`main()`: parse the command line, run the command, turn every failure into an exit status.

Every user error is a diagnostic on stderr and exit status 1; a usage error is exit
status 2; a Python traceback is shown only under `--debug`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pipelang import __version__
from pipelang.cli import (
    check,
    check_streams,
    explain,
    export,
    import_torch,
    plan,
    profile,
    simulate,
    viz,
)
from pipelang.cli import compile as compile_command
from pipelang.cli import list as list_command
from pipelang.cli import run as run_command
from pipelang.cli.args import UsageError
from pipelang.diagnostics import InternalError, PipelangError

# name -> module with HELP, setup(parser) and run(args); `pipelang --help` lists them so
COMMANDS = {
    "list": list_command,
    "check": check,
    "compile": compile_command,
    "simulate": simulate,
    "viz": viz,
    "export": export,
    "run": run_command,
    "explain": explain,
    "check-streams": check_streams,
    "import-torch": import_torch,
    "profile": profile,
    "plan": plan,
}

EXAMPLES = """\
examples:
  pipelang list
  pipelang check chimera -p D=8 -p N=8
  pipelang simulate 1f1b -p D=4 -p N=8 --cost F=1,B=2 --json
  pipelang compile my_schedule.pipe -p N=16 -o build/
  pipelang explain E0306
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipelang` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(COMMANDS[args.command].run(args))
    except UsageError as err:
        print(f"pipelang {args.command}: error: {err}", file=sys.stderr)
        return 2
    except PipelangError as err:
        if getattr(args, "format", None) == "json":
            print(err.to_json())
        else:
            print(err.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pipelang export ... | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (InternalError, Exception) as err:
        if args.debug:
            raise
        print(
            f"internal error: {type(err).__name__}: {err}\n"
            "this is a bug in pipelang; run again with --debug for the traceback",
            file=sys.stderr,
        )
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: global options and one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="pipelang",
        description="Write pipeline-parallel training schedules as .pipe files; check, "
        "simulate, and compile them to one torch program per rank.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pipelang {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks for internal errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        command.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show Python tracebacks for internal errors",
        )
        module.setup(command)
    return parser
