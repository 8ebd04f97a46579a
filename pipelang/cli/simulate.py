"""`pipelang simulate`: replay a schedule under a cost model; makespan, bubbles, memory."""

from __future__ import annotations

import argparse
import json
from typing import cast

from rich.table import Table

from pipelang.cli import memory_table
from pipelang.cli.args import (
    add_cost_argument,
    add_schedule_arguments,
    add_shard_arguments,
    add_slot_model_arguments,
    compile_args,
    data_slot_bytes,
    describe,
    parse_cost,
)
from pipelang.compiler import SCHEDULE_DONE
from pipelang.progress import console

HELP = "replay a schedule with a cost model: makespan, bubbles, memory"


def setup(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    add_cost_argument(parser)
    add_shard_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    parser.add_argument("--grid", action="store_true", help="also print the rank x time grid")
    parser.add_argument(
        "--slots",
        action="store_true",
        help="also lower to the stream program and give each rank's static buffer slots "
        "(data, saved, grads; docs/runtime.md), and with --model their bytes; its cost "
        "grows with ranks x ops",
    )
    add_slot_model_arguments(parser, activations=True)
    memory_table.add_state_arguments(parser)


TABLE_RANKS = 64
"""The most ranks the text table shows (a table of 10^5 rows takes minutes to draw)."""


def run(args: argparse.Namespace) -> int:
    costs = parse_cost(args.cost)
    memory_table.check_state_arguments(args)
    # sharded stages have no stream program yet (E0506): their data slots only on --slots
    slots = args.slots or (args.model is not None and not args.shard)
    compiled = compile_args(args, "check-streams" if slots else SCHEDULE_DONE)
    program = compiled.need_program()
    timeline = compiled.timeline(costs)
    metrics = timeline.metrics()
    rows = cast(list[dict[str, object]], metrics["ranks"])
    if compiled.streams is not None:
        nbytes = data_slot_bytes(args, program, compiled.streams)
        for rank, row in enumerate(rows):
            row["slots"] = {cls: len(names) for cls, names in compiled.streams.slots(rank).items()}
            if nbytes is not None:
                row["data_slot_bytes"] = nbytes[rank]
    held = memory_table.activation_bytes(args, program, timeline.costs)
    for row, peak in zip(rows, held or (), strict=False):
        row["peak_activation_bytes"] = round(peak)
    memory = memory_table.memory_rows(args, program, held)
    if memory is not None:
        metrics["memory"] = memory
    if args.json:
        print(json.dumps(metrics, allow_nan=False))  # strict JSON: costs are bounded
        return 0
    out = console()
    out.print(f"{describe(program)}")
    out.print(f"makespan {metrics['makespan']}   bubble ratio {metrics['bubble_ratio']:.4f}")
    table = Table()
    keys = ["rank", "busy", "idle", "peak_activations", "weight_copies"]
    if program.weights is not None:  # asynchronous: versions and staleness matter
        keys += ["peak_weight_versions", "weight_delay"]
    for key in keys:
        table.add_column(key.replace("_", " ").replace("peak weight", "weight"), justify="right")
    if compiled.streams is not None:
        keys.append("slots")
        table.add_column("slots (data, saved, grads)", justify="right")
    if args.model is not None:
        if compiled.streams is not None:
            keys.append("data_slot_bytes")
            table.add_column(f"data slot bytes ({args.model})", justify="right")
        keys.append("peak_activation_bytes")
        table.add_column("peak activation bytes", justify="right")
    rows = cast(list[dict[str, object]], metrics["ranks"])
    for row in rows[:TABLE_RANKS]:
        cells = [
            ", ".join(map(str, cast(dict[str, int], row[k]).values()))
            if k == "slots"
            else f"{row[k]:,}"
            if k in ("data_slot_bytes", "peak_activation_bytes")
            else str(row[k])
            for k in keys
        ]
        table.add_row(*cells)
    out.print(table)
    if len(rows) > TABLE_RANKS:
        out.print(f"... and {len(rows) - TABLE_RANKS} more ranks (--json lists every rank)")
    if memory is not None:
        out.print(memory_table.memory_table(args, memory, TABLE_RANKS))
        if len(memory) > TABLE_RANKS:
            out.print(f"... and {len(memory) - TABLE_RANKS} more processes (--json lists each)")
    if args.grid:
        print(timeline.text_grid())
    return 0
