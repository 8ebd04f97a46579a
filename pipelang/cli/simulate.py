"""`pipelang simulate`: replay a schedule under a cost model; makespan, bubbles, memory."""

from __future__ import annotations

import argparse
import json
from typing import cast

from rich.console import Console
from rich.table import Table

from pipelang import memory
from pipelang.cli.args import (
    add_schedule_arguments,
    check_cost_stages,
    compile_args,
    describe,
    parse_cost,
)
from pipelang.ir import Kind

HELP = "replay a schedule with a cost model: makespan, bubbles, memory"


def setup(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--cost",
        metavar="SPEC",
        default="",
        help="op times, e.g. F=1,B=2,W=1,C=0.1; per stage: F[3]=2; evicted "
        "activations' trips to the partner and back: E=0.5,L=0.5. "
        "Defaults come from the schedule's `cost` line, else 1 (C=0)",
    )
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    parser.add_argument("--grid", action="store_true", help="also print the rank x time grid")
    parser.add_argument(
        "--slots",
        action="store_true",
        help="also lower to the stream program and give each rank's static buffer slots "
        "(data, saved, grads; docs/runtime.md); its cost grows with ranks x ops",
    )


def run(args: argparse.Namespace) -> int:
    costs = parse_cost(args.cost)
    compiled = compile_args(args, "check-streams" if args.slots else None)
    program = compiled.need_program()
    check_cost_stages(costs, args.cost, program)
    timeline = compiled.timeline(costs)
    metrics = timeline.metrics()
    if compiled.streams is not None:
        for rank, row in enumerate(cast(list[dict[str, object]], metrics["ranks"])):
            slots = compiled.streams.slots(rank).items()
            row["slots"] = {cls: len(names) for cls, names in slots}
    if args.json:
        print(json.dumps(metrics, allow_nan=False))  # strict JSON: costs are bounded
        return 0
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"{describe(program)}")
    console.print(f"makespan {metrics['makespan']}   bubble ratio {metrics['bubble_ratio']:.4f}")
    table = Table()
    keys = ["rank", "busy", "idle", "peak_activations", "weight_copies"]
    if program.weights is not None:  # asynchronous: versions and staleness matter
        keys += ["peak_weight_versions", "weight_delay"]
    for key in keys:
        table.add_column(key.replace("_", " ").replace("peak weight", "weight"), justify="right")
    if compiled.streams is not None:
        keys.append("slots")
        table.add_column("slots (data, saved, grads)", justify="right")
    for row in cast(list[dict[str, object]], metrics["ranks"]):
        cells = [str(row[k]) for k in keys if k != "slots"]
        if "slots" in row:
            cells.append(", ".join(map(str, cast(dict[str, int], row["slots"]).values())))
        table.add_row(*cells)
    console.print(table)
    if Kind.W in program.kinds:
        held = [memory.peak(actions, Kind.W) for actions in program.ranks]
        if held != [timeline.peak_activations(r) for r in range(program.num_ranks)]:
            console.print(
                "note: peak activations count a forward until its B, as the papers do; "
                "pipelang's runtime holds it until its W, so a run holds "
                f"{', '.join(map(str, held))} (docs/runtime.md)",
                markup=False,
            )
    if args.grid:
        print(timeline.text_grid())
    return 0
