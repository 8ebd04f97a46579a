"""`pipelang explain CODE`: what a diagnostic code means and how to fix it."""

from __future__ import annotations

import argparse

from pipelang.cli.args import UsageError
from pipelang.codes import CODES

HELP = "explain a diagnostic code"


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "code", metavar="CODE", help="a diagnostic code such as E0306 (or e0306, 306)"
    )


def normalized(text: str) -> str:
    """`E0306` from `E0306`, `e0306`, `0306` or `306`."""
    text = text.strip().upper()
    digits = text.removeprefix("E")
    return f"E{int(digits):04d}" if digits.isdigit() and len(digits) <= 4 else text


def run(args: argparse.Namespace) -> int:
    code = CODES.get(normalized(args.code))
    if code is None:
        raise UsageError(f"no diagnostic code `{args.code}`; codes are {min(CODES)}..{max(CODES)}")
    print(f"{code.code}: {code.title}\n\n{code.explanation}")
    return 0
