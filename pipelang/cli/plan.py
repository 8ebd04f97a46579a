"""`pipelang plan`: choose schedule, partition and device mapping from a profile and a
topology; write the winner as a `.pipe` file and rank the rest."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.table import Table

from pipelang.cli.args import (
    UsageError,
    path,
    positive,
    seconds_or_zero,
    writable,
    write_output,
)
from pipelang.diagnostics import PipelangError, fail
from pipelang.planner.units import UnitError, format_bytes, parse_bytes
from pipelang.planner.units import positive as more_than_0
from pipelang.progress import console, work_progress

HELP = "choose schedule, partition and device mapping for a model on a cluster"

_console = console()


def setup(parser: argparse.ArgumentParser) -> None:
    from pipelang.planner.families import FAMILIES, STATE_FACTOR

    parser.add_argument(
        "--profile",
        type=path,
        required=True,
        metavar="P.json",
        help="per-layer times and memory, as `pipelang profile` writes them",
    )
    parser.add_argument(
        "--topology",
        type=path,
        required=True,
        metavar="T.yaml",
        help="the devices (count, memory, optional kind, relative speed, node and "
        "datacenter) and the links between them, by pair or by class: within a node, "
        "across nodes, across datacenters (docs/planner.md); a profile from another kind "
        "of device is noted, and faster devices get more layers",
    )
    parser.add_argument(
        "--micro-batches",
        type=positive,
        required=True,
        metavar="N",
        help="micro-batches per iteration (the N of every candidate schedule)",
    )
    parser.add_argument(
        "-o", dest="out", type=path, required=True, metavar="BEST.pipe", help="the winning plan"
    )
    parser.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="memory cap per device, e.g. 40GiB (default: each device's memory)",
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(STATE_FACTOR),
        default="adam",
        help="what the optimizer state adds to each device's memory (default adam)",
    )
    parser.add_argument(
        "--data-parallel",
        action="store_true",
        help="also plan W copies of a pipeline on devices/W devices each, N/W micro-batches "
        "per copy (run with `pipelang run --dp W`); a longer search",
    )
    parser.add_argument(
        "--schedules",
        metavar="A,B,...",
        help="stdlib schedules to try (default all of: " + ", ".join(FAMILIES) + ")",
    )
    parser.add_argument(
        "--time-budget",
        type=seconds_or_zero,
        default=8.0,
        metavar="SECONDS",
        help="stop adding candidates that would end the search past this (default 8, so "
        "that `plan` answers within about 10 s; 0: none)",
    )
    parser.add_argument(
        "--top",
        type=positive,
        default=10,
        help="rows of the table (default 10); a row marked `!` is lopsided (some stage does "
        "under a tenth of the heaviest one's work), said under the table",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="also list every candidate left out, and why (a failed `require`, the memory "
        "cap, the time budget, or a lower bound above the fastest plans found)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the ranking as JSON (each plan's `lopsided` reason or null)",
    )


def run(args: argparse.Namespace) -> int:
    from pipelang.planner.plans import Inputs
    from pipelang.planner.search import Planner
    from pipelang.planner.topology import load_topology
    from pipelang.planner.write import plan_source
    from pipelang.profile import load_profile

    writable(args.out)  # before the search, not after
    started = time.perf_counter()  # reading the inputs counts against --time-budget
    max_memory = None
    if args.max_memory is not None:
        try:
            max_memory = more_than_0(parse_bytes, "--max-memory")(args.max_memory)
        except UnitError as err:
            raise UsageError(f"--max-memory: {err}") from None
    schedules = _schedules(args.schedules)
    profile = load_profile(args.profile)
    inputs = Inputs(
        profile,
        load_topology(args.topology),
        args.micro_batches,
        max_memory,
        args.optimizer,
        schedules,
        args.data_parallel,
    )
    notes = console(stderr=True)
    for note in inputs.notes():
        notes.print(f"note: {note}", markup=False)
    left = max(args.time_budget - (time.perf_counter() - started), 0.1)
    planner = Planner(inputs, time_budget=left if args.time_budget else None)
    with work_progress(notes) as update:
        result = planner.search(update)
    if not result.plans:
        raise _nothing_fits(result, args.time_budget)
    best = result.plans[0]
    write_output(args.out, plan_source(best, planner, args.profile.name, args.topology.name))
    if args.json:
        print(json.dumps(_as_json(result), indent=1, allow_nan=False))
        return 0
    _print_tables(result, planner, args.top, args.all)
    _console.print(
        f"wrote {args.out}: {best.candidate.label}, partition "
        f"{','.join(map(str, best.partition))}, predicted {best.time_ms:.3f} ms per iteration",
        markup=False,
    )
    _print_how_to_run(best, inputs.topology.size, args)
    return 0


def _schedules(given: str | None) -> tuple[str, ...]:
    """The families `--schedules` names (all by default); a usage error for others."""
    from pipelang.planner.families import FAMILIES

    if not given:
        return tuple(FAMILIES)
    schedules = tuple(s.strip() for s in given.split(",") if s.strip())
    unknown = [s for s in schedules if s not in FAMILIES]
    if unknown or not schedules:
        raise UsageError(
            f"--schedules: cannot plan with `{', '.join(unknown)}`; use: {', '.join(FAMILIES)}"
        )
    return schedules


def _nothing_fits(result: Any, budget: float) -> PipelangError:
    """E0403, with why each candidate was left out (the budget, when it ran out)."""
    reasons = [f"{r.candidate.label}: {r.reason}" for r in result.rejected]
    shown = reasons[:12] + ([f"... and {len(reasons) - 12} more"] if len(reasons) > 12 else [])
    timed_out = sum(r.time for r in result.rejected)
    if timed_out:
        return fail(
            "E0403",
            f"no plan found within --time-budget {budget:g} s: {timed_out} of "
            f"the {len(result.rejected)} candidates were not searched for lack of time",
            notes=tuple(shown),
            help="raise --time-budget (0: no budget), or plan for fewer devices or layers",
        )
    return fail(
        "E0403",
        f"no plan fits: all {len(result.rejected)} candidates were left out",
        notes=tuple(shown),
        help="raise --max-memory, add devices, or profile a smaller micro-batch",
    )


def _print_how_to_run(best: Any, size: int, args: argparse.Namespace) -> None:
    """How to run the written plan, and what the devices it leaves idle could do."""
    ranks, dp = best.candidate.ranks, best.candidate.dp
    if dp > 1:
        _console.print(
            f"run it with `pipelang run {args.out} --dp {dp}`: {dp} copies of the pipeline, "
            f"each on {ranks} device{'s' if ranks > 1 else ''} with "
            f"N = {dict(best.candidate.params)['N']} micro-batches",
            markup=False,
        )
    elif ranks < size and args.data_parallel:
        _console.print(
            f"note: the plan uses {ranks} of the {size} devices; copies on the rest were "
            "slower (`--top` shows them as `dp=W`)",
            markup=False,
        )
    elif ranks < size:  # D divides the device count (`candidates`)
        _console.print(
            f"note: the plan uses {ranks} of the {size} devices; `--data-parallel` plans "
            f"copies of a pipeline on the rest (`pipelang run {args.out} --dp {size // ranks}` "
            "runs such copies, each with its own micro-batches)",
            markup=False,
        )


def _print_tables(result: object, planner: object, top: int, show_all: bool) -> None:
    from pipelang.planner.plans import SearchResult
    from pipelang.planner.search import Planner

    assert isinstance(result, SearchResult) and isinstance(planner, Planner)
    inputs = planner.inputs
    profile = inputs.profile
    table = Table(
        title=f"plans for {profile.model} ({len(profile.layers)} layers), "
        f"{inputs.micro_batches} micro-batches, {inputs.topology.size} devices "
        f"({len(result.plans) + len(result.rejected)} candidates, {result.seconds:.1f} s)",
        title_justify="left",
    )
    shown = result.plans[:top]
    name_width = max(len(p.candidate.schedule) for p in shown)  # its parameters may wrap
    for column in ("#", "schedule", "partition", "iteration ms", "bubble", "peak memory"):
        left = column in ("schedule", "partition")
        width = name_width if column == "schedule" else None
        table.add_column(column, justify="left" if left else "right", min_width=width)
    best = result.plans[0].time_ms
    for index, plan in enumerate(shown):
        peak, rank = plan.peak()
        parts = ",".join(map(str, plan.partition))
        approx = "" if plan.exact else "~"
        table.add_row(
            f"{index + 1}{'!' if plan.lopsided else ''}",
            plan.candidate.label,
            parts if len(parts) <= 40 else parts[:37] + "...",
            f"{approx}{plan.time_ms:.3f}" + (f" (+{plan.time_ms / best - 1:.0%})" if index else ""),
            f"{plan.bubble_ratio:.3f}",
            f"{format_bytes(peak)} (rank {rank})",
        )
    _console.print(table)
    for index, plan in enumerate(shown):
        if plan.lopsided:
            _console.print(f"{index + 1}!: {plan.lopsided}", markup=False)
    memory = [r for r in result.rejected if r.memory]
    others = [r for r in result.rejected if not r.memory]
    listed = memory + (others if show_all else [])
    if listed:
        out = Table(title="left out", title_justify="left")
        out.add_column("schedule")
        out.add_column("why")
        for rejected in listed:
            out.add_row(rejected.candidate.label, rejected.reason)
        _console.print(out)
    if others and not show_all:
        bound = sum(r.reason.startswith("not simulated") for r in others)
        budget = sum(r.reason.startswith("not searched") for r in others)
        counts = [
            f"{bound} by the lower bound (slower than the fastest plans found)" * bool(bound),
            f"{budget} by the time budget" * bool(budget),
            f"{len(others) - bound - budget} by their schedule's `require` or the model's size"
            * bool(len(others) - bound - budget),
        ]
        _console.print(
            f"{len(others)} more left out: {', '.join(c for c in counts if c)} (--all lists them)",
            markup=False,
        )
    if any(not p.exact for p in result.plans[:top]):
        _console.print(
            "~ extrapolated from two smaller micro-batch counts (only the best few are "
            "simulated at N)",
            markup=False,
        )


def _as_json(result: object) -> dict[str, object]:
    from pipelang.planner.plans import SearchResult

    assert isinstance(result, SearchResult)
    return {
        "seconds": round(result.seconds, 3),
        "plans": [
            {
                "schedule": p.candidate.schedule,
                "params": dict(p.candidate.params),
                "dp": p.candidate.dp,
                "partition": list(p.partition),
                "devices": list(p.devices),
                "iteration_ms": round(p.time_ms, 6),
                "bubble_ratio": round(p.bubble_ratio, 6),
                "peak_memory_bytes": [round(m) for m in p.memory],
                "exact": p.exact,
                "lopsided": p.lopsided,
            }
            for p in result.plans
        ],
        "left_out": [
            {
                "schedule": r.candidate.schedule,
                "params": dict(r.candidate.params),
                "reason": r.reason,
                "memory": r.memory,
            }
            for r in result.rejected
        ],
    }
