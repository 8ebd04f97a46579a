"""The `pipelang` command: list, check, compile, simulate, export, explain, run.

Every user error is a diagnostic on stderr and exit status 1; a usage error is exit
status 2; a Python traceback is shown only under `--debug`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipelang import __version__
from pipelang.diagnostics import InternalError, PipelangError

EXAMPLES = """\
examples:
  pipelang list
  pipelang check chimera -p D=8 -p N=8
  pipelang simulate 1f1b -p D=4 -p N=8 --cost F=1,B=2 --json
  pipelang compile my_schedule.pipe -p N=16 -o build/
  pipelang explain E0306
"""


class UsageError(Exception):
    """A bad command line (exit status 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipelang` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args))
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


def _parser() -> argparse.ArgumentParser:
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
    from pipelang import commands

    for name, (helptext, setup, handler) in commands.COMMANDS.items():
        command = sub.add_parser(name, help=helptext, description=helptext)
        command.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show Python tracebacks for internal errors",
        )
        setup(command)
        command.set_defaults(handler=handler)
    return parser


def add_param_option(parser: argparse.ArgumentParser, help: str) -> None:
    """`-p NAME=VALUE`, repeatable, into `args.params` (read with `parse_params`)."""
    parser.add_argument(
        "-p", dest="params", action="append", default=[], metavar="NAME=VALUE", help=help
    )


def parse_params(pairs: Sequence[str]) -> dict[str, str]:
    """`-p K=V` strings into a dict; a malformed one is a usage error."""
    params: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"`-p {pair}`: expected NAME=VALUE, e.g. `-p D=4`")
        params[name.strip()] = value
    return params


def write_output(path: Path, text: str) -> None:
    """Write a file the user asked for, creating its folder; failures are usage errors."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as err:
        raise UsageError(f"cannot write `{path}`: {err.strerror}") from None


Handler = Callable[[argparse.Namespace], int]

if __name__ == "__main__":
    # `python -m pipelang.cli` runs this file as `__main__`, a second copy of the module;
    # use the real `pipelang.cli`, whose `UsageError` is the one `commands` raises.
    from pipelang.cli import main as _main

    sys.exit(_main())
