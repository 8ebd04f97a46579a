"""`pipelang check-streams DUMP`: check a stream program's text (docs/runtime.md)."""

from __future__ import annotations

import argparse
import json

from pipelang.cli.args import path
from pipelang.diagnostics import fail, quote

HELP = (
    "check a stream program dump (`compile SCHED --dump-after streams`, perhaps edited): "
    "no slot race, no wait cycle, channels in order"
)


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", metavar="DUMP", type=path, help="the text of a stream program")
    parser.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    from pipelang.ir.streams import StreamProgram, StreamSyntaxError
    from pipelang.passes.check_streams import check_streams
    from pipelang.readers import ReadError, read_text

    try:
        text = read_text(args.dump)
    except ReadError as err:
        raise fail("E0003", f"cannot read {quote(args.dump)}: {err}") from None
    try:
        program = StreamProgram.parse(text, str(args.dump))
    except StreamSyntaxError as err:
        raise fail("E0501", f"not a stream program line: {err}", err.span) from None
    check_streams(program)
    streams = len(program.streams())
    message = (
        f"ok: {len(program.ops)} ops on {streams} streams of {program.ranks} processes: "
        "no slot race, no wait cycle, every channel in order"
    )
    print(json.dumps({"ok": True, "diagnostics": []}) if args.format == "json" else message)
    return 0
