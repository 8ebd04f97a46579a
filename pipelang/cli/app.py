"""`main()`: parse the command line, run the command, turn every failure into an exit status.

Every user error is a diagnostic on stderr and exit status 1; a usage error is exit
status 2; a Python traceback is shown only under `--debug`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from pipelang import __version__
from pipelang.cli import (
    check,
    check_streams,
    explain,
    export,
    import_torch,
    pack,
    plan,
    profile,
    simulate,
    synthesize,
    tokenize,
    viz,
)
from pipelang.cli import compile as compile_command
from pipelang.cli import list as list_command
from pipelang.cli import run as run_command
from pipelang.cli.args import UsageError
from pipelang.diagnostics import ECHOED, InternalError, PipelangError, clip

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
    "pack": pack,
    "synthesize": synthesize,
    "tokenize": tokenize,
}

EXAMPLES = """\
exit status: 0 success; 1 the schedule (or the run) has errors, shown as diagnostics;
2 a bad command line. With --json or --format json, errors are also a JSON object on
standard output.

examples:
  pipelang list
  pipelang check chimera -p D=8 -p N=8
  pipelang simulate 1f1b -p D=4 -p N=8 --cost F=1,B=2 --json
  pipelang compile my_schedule.pipe -p N=16 -o build/
  pipelang explain E0306
"""


def console() -> NoReturn:
    """The `pipelang` console script and `python -m pipelang.cli`: `main()`, then `leave`."""
    leave(main())


def leave(status: int) -> NoReturn:
    """Exit with `status` as Python would, less the interpreter's teardown: wait for the
    threads Python would wait for, run the exit handlers (multiprocessing's, which stop
    the forkserver), flush stdout and stderr, then `os._exit`. Tearing down torch's
    modules alone takes about half a second per process (measured on the 2-core VM:
    `import torch` then a normal exit 1.6-2.0 s, with this 1.1-1.2 s), which every run,
    and every rank under torchrun, would pay after its work is done."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that left, say
            stream.flush()
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipelang` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _BadArguments as err:
        err.parser.print_usage(sys.stderr)
        return _usage_error(f"{err.parser.prog}: error: {err}", _wants_json(argv))
    if args.command is None:
        parser.print_help()
        return 2
    as_json = _wants_json(argv)
    if getattr(args, "config", None) is not None:  # `run --config FILE`: its options first
        try:
            args = _configured(parser, args, argv)
        except UsageError as err:
            return _usage_error(f"pipelang {args.command}: error: {err}", as_json)
        except _BadArguments as err:
            err.parser.print_usage(sys.stderr)
            return _usage_error(f"{err.parser.prog}: error: {err}", as_json)
    try:
        return int(COMMANDS[args.command].run(args))
    except UsageError as err:
        return _usage_error(f"pipelang {args.command}: error: {err}", as_json)
    except PipelangError as err:
        if err.diagnostics and all(d.code == "usage" for d in err.diagnostics):  # the API's
            message = "; ".join(d.message for d in err.diagnostics)  # word on the arguments
            return _usage_error(f"pipelang {args.command}: error: {message}", as_json)
        print(err.render(), file=sys.stderr)
        if as_json:
            print(err.to_json())
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pipelang export ... | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (InternalError, Exception) as err:
        if args.debug:
            raise
        message = f"internal error: {type(err).__name__}: {clip(str(err))}"
        print(
            f"{message}\nthis is a bug in pipelang; run again with --debug for the traceback",
            file=sys.stderr,
        )
        if as_json:
            _print_json_error("internal", message)
        return 1


def _configured(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]
) -> argparse.Namespace:
    """The command line parsed again over the --config file's options as defaults, so
    that the options given on it override the file's (cli/config_file.py)."""
    from pipelang.cli.config_file import read_config

    command = COMMAND_PARSERS[args.command]
    command.set_defaults(**read_config(args.config, command))
    return parser.parse_args(argv)


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether the command line asks for JSON (`--json`, `--format json`): its errors
    then also go to stdout as a JSON object."""
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    return "--json" in argv or "--format=json" in argv or ("--format", "json") in pairs


def _usage_error(message: str, as_json: bool) -> int:
    """A bad command line: the message on stderr (and as JSON on stdout); exit 2. Clipped
    as diagnostics are (`diagnostics.clip`): a usage error may quote what was typed."""
    message = clip(message, runs=True, longest=ECHOED)  # a path of 200 characters stays whole
    print(message, file=sys.stderr)
    if as_json:
        _print_json_error("usage", message)
    return 2


def _print_json_error(code: str, message: str) -> None:
    """An error that has no diagnostic of its own, as the JSON object `--json` promises."""
    diagnostic = {"severity": "error", "code": code, "message": message}
    where = {"file": None, "line": None, "column": None, "location": None}
    print(json.dumps({"ok": False, "diagnostics": [{**diagnostic, **where}]}, indent=2))


class _BadArguments(Exception):
    """argparse found the command line wrong (exit 2)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, raising instead of exiting, so that `main` answers usage errors
    in one place (and in JSON when asked); subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise _BadArguments(self, message)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: global options and one subparser per command."""
    parser = _Parser(
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
        COMMAND_PARSERS[name] = command
    return parser


COMMAND_PARSERS: dict[str, argparse.ArgumentParser] = {}
"""Each command's parser, as the last `build_parser` made it."""
