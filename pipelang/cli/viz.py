"""`pipelang viz`: draw one or more schedules, or a measured run, to a file or the terminal.

pipelang viz chimera -p D=4 -o chimera.svg
pipelang viz 1f1b chimera zbv -p D=8 -p N=16 -o cmp.html     # compared on one scale
pipelang viz 1f1b -p D=4 -p N=8 --cost F=1,B=2                 # text grid on stdout
pipelang viz 1f1b -p D=2 -p N=4 --trace run.json --overlay -o run.svg
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelang.cli.args import (
    UsageError,
    add_cost_argument,
    add_lengths_argument,
    add_param_options,
    add_shard_arguments,
    at_least_zero,
    compile_args,
    parse_cost,
    path,
    schedule_name,
    write_output,
)
from pipelang.compiler import SCHEDULE_DONE, Compilation, check_program
from pipelang.ir import CostModel, Program
from pipelang.sim.timeline import Event, Timeline
from pipelang.visualize import FORMATS, render
from pipelang.visualize.panel import Panel, simulated
from pipelang.visualize.png import MissingMatplotlib, TooLarge

HELP = "draw a schedule's timeline (svg, html, png, Chrome trace json, text), or a run's"


def setup(parser: argparse.ArgumentParser) -> None:
    """The options of `pipelang viz`."""
    parser.add_argument(
        "scheds",
        nargs="*",
        type=schedule_name,
        metavar="SCHED",
        help="a .pipe file or a stdlib name; several are drawn one under another on one time scale",
    )
    add_param_options(parser, "set a schedule parameter, for every SCHED; repeat for several")
    add_lengths_argument(parser)
    add_cost_argument(
        parser,
        "; with --trace, only with --overlay: the model's, in milliseconds, over the "
        "times fitted to the trace",
    )
    add_shard_arguments(parser)
    parser.add_argument(
        "-o",
        dest="out",
        metavar="OUT",
        help="OUT.svg, .html, .png, .json (Chrome/Perfetto trace) or .txt; "
        "`-` or none prints the text grid",
    )
    parser.add_argument(
        "--comms",
        action="store_true",
        help="draw transfers between ranks (and a run's send/recv actions)",
    )
    parser.add_argument(
        "--trace",
        type=path,
        metavar="RUN.json",
        help="draw the run that `pipelang run --trace RUN.json` recorded",
    )
    parser.add_argument(
        "--step",
        type=at_least_zero,
        metavar="K",
        help="with --trace: the training step to draw (default: the last)",
    )
    parser.add_argument(
        "--overlay",
        action="store_true",
        help="with --trace: draw the simulated timeline of the same order under each measured rank",
    )


def run(args: argparse.Namespace) -> int:
    """Build the panels, render them in the format OUT's suffix names, write or print."""
    suffix = _suffix(args.out)
    panels = _measured_panels(args) if args.trace else _simulated_panels(args)
    try:
        data = render(panels, suffix, args.comms)
    except (MissingMatplotlib, TooLarge) as err:
        raise UsageError(str(err)) from None
    if args.out in (None, "-"):
        sys.stdout.write(str(data))
        return 0
    write_output(Path(args.out), data)
    names = ", ".join(p.name for p in panels)
    print(f"wrote {args.out}: {names}")
    return 0


def _suffix(out: str | None) -> str:
    if out in (None, "-"):
        return ".txt"
    suffix = Path(out).suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(
            f"`-o {out}`: cannot tell the format; give a name ending in "
            + ", ".join(FORMATS)
            + ", or `-` for the terminal"
        )
    return suffix


def _simulated_panels(args: argparse.Namespace) -> list[Panel]:
    if not args.scheds:
        raise UsageError(
            "give a schedule to draw (`pipelang viz 1f1b -p D=4`), or --trace RUN.json"
        )
    for flag in ("step", "overlay"):
        if getattr(args, flag):
            raise UsageError(f"--{flag} needs --trace RUN.json")
    costs = parse_cost(args.cost)
    panels = []
    for sched in args.scheds:
        compiled = _compile(sched, args)
        panels.append(simulated(compiled.timeline(costs)))
    return panels


def _measured_panels(args: argparse.Namespace) -> list[Panel]:
    from pipelang.passes.layout import given_costs
    from pipelang.visualize.measured import TraceError, fitted_costs, read_trace

    if len(args.scheds) > 1:
        raise UsageError("--trace draws one run: give at most one SCHED (the one it ran)")
    if args.params and not args.scheds:
        raise UsageError("-p sets the parameters of a SCHED; give the schedule the trace ran")
    if args.lengths is not None and not args.scheds:
        raise UsageError(
            "--lengths with --trace gives the micro-batch shapes of a SCHED; give the "
            "schedule the trace ran"
        )
    if args.cost and not args.overlay:
        raise UsageError(
            "--cost with --trace needs --overlay: the run is drawn in its measured times, "
            "and --cost sets the model's"
        )
    # the schedule as the run compiled it: `run` takes no --cost, which is the model's here
    as_run = argparse.Namespace(**{**vars(args), "cost": None})
    program = _compile(args.scheds[0], as_run).need_program() if args.scheds else None
    try:
        measured = read_trace(args.trace, program, args.step)
    except TraceError as err:
        raise UsageError(str(err)) from None
    overlay = None
    if args.overlay:
        timeline, ran = measured.timeline, measured.timeline.program
        given = parse_cost(args.cost)
        costs = given_costs(fitted_costs(timeline), given, ran.name, ran.num_stages)
        overlay = _aligned(_replay(timeline.program, costs), timeline)
    return [measured.panel(overlay)]


def _aligned(model: Timeline, measured: Timeline) -> Timeline:
    """The model shifted to start with the measured run's first compute op (ranks leave
    the previous step at different times; the model starts them all at 0)."""
    shift = min((e.start for e in measured.events), default=0.0)
    events = tuple(Event(e.rank, e.action, e.start + shift, e.end + shift) for e in model.events)
    return Timeline(model.program, model.costs, events)


def _compile(sched: str, args: argparse.Namespace) -> Compilation:
    return compile_args(args, SCHEDULE_DONE, sched)


def _replay(program: Program, costs: CostModel) -> Timeline:
    """The order a run ran (the trace's, or SCHED's), simulated under `costs` alone."""
    from pipelang.sim.timeline import simulate

    checked = check_program(program)
    return simulate(program, checked.need_graph(), costs.for_kinds(program.kinds))
