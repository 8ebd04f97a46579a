"""Draw the example pictures under docs/img/ with `pipelang viz` (SVG and PNG).

    python docs/make_images.py            # needs matplotlib for the PNGs: pip install -e '.[viz]'

Schedules missing from the standard library are skipped with a note (DualPipeV is not
in it yet). The measured example is drawn from a trace recorded with
`pipelang run chimera -p D=4 -p N=4 --backend gloo --steps 3 --trace ...` (kept in
tests/data/ for the tests too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipelang.api import stdlib_names
from pipelang.cli import main

ROOT = Path(__file__).resolve().parent.parent
OUT = Path("docs/img")

PICTURES = {
    "chimera": ["chimera", "-p", "D=4", "-p", "N=8"],
    "1f1b": ["1f1b", "-p", "D=4", "-p", "N=8"],
    "zbv": ["zbv", "-p", "D=4", "-p", "N=8"],
    "dualpipev": ["dualpipev", "-p", "D=4", "-p", "N=8"],
    # docs/synthesize.md: the best stdlib order within the cap against the synthesized one
    "synthesized": [
        "zb-h1",
        "examples/zb-synth-4x8.pipe",
        *("-p", "D=4", "-p", "N=8", "--cost", "F=1,B=1,W=1,C=0.5"),
    ],
}
MEASURED = {
    "chimera-measured": [
        "chimera",
        "-p",
        "D=4",
        "-p",
        "N=4",
        "--trace",
        "tests/data/trace_chimera_D4_N4.json",
        "--overlay",
    ],
}


def draw_all() -> int:
    os.chdir(ROOT)
    OUT.mkdir(parents=True, exist_ok=True)
    status = 0
    for name, args in {**PICTURES, **MEASURED}.items():
        if args[0] not in stdlib_names():
            print(f"skipped {name}: `{args[0]}` is not in the standard library")
            continue
        for suffix in (".svg", ".png"):
            status |= main(["viz", *args, "-o", str(OUT / f"{name}{suffix}")])
    return status


if __name__ == "__main__":
    sys.exit(draw_all())
