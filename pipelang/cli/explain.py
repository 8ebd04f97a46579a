"""`pipelang explain CODE`: what a diagnostic code means and how to fix it."""

from __future__ import annotations

import argparse
import re

from pipelang.cli.args import UsageError
from pipelang.codes import CODES
from pipelang.diagnostics import quote

HELP = "explain a diagnostic code"


def setup(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "code", metavar="CODE", help="a diagnostic code such as E0306 (or e0306, 306)"
    )


_CODE = re.compile(r"[Ee]?([0-9]{1,4})", re.ASCII)
"""A code as it may be written: ASCII digits only (`²` or `٣` are digits to Python's
`isdigit`, and no code)."""


def normalized(text: str) -> str | None:
    """`E0306` from `E0306`, `e0306`, `0306` or `306`; None for text that is no code."""
    found = _CODE.fullmatch(text.strip(" \t"))
    return None if found is None else f"E{int(found[1]):04d}"


def run(args: argparse.Namespace) -> int:
    name = normalized(args.code)
    code = None if name is None else CODES.get(name)
    if code is None:
        raise UsageError(
            f"no diagnostic code {quote(args.code)}; codes are {min(CODES)}..{max(CODES)} "
            "(E followed by four digits, such as E0306)"
        )
    print(f"{code.code}: {code.title}\n\n{code.explanation}")
    return 0
