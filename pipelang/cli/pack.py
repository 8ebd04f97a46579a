"""`pipelang pack`: group sequence lengths into micro-batches for a schedule (DynaPipe)."""

from __future__ import annotations

import argparse
import math
import time
from typing import TYPE_CHECKING

from rich.table import Table

from pipelang.cli.args import (
    UsageError,
    add_cost_argument,
    add_param_options,
    parse_cost,
    parse_params,
    path,
    positive,
    schedule_name,
    seconds_or_zero,
    write_output,
)
from pipelang.ir import CostModel
from pipelang.progress import console
from pipelang.readers import read_number_rows

if TYPE_CHECKING:
    from pipelang.pack import Packing

SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Sequences per micro-batch the fixed-size baselines try."""

HELP = "group sequence lengths into micro-batches of different shapes for a schedule"

DESCRIPTION = """\
Dynamic micro-batching (DynaPipe): reads one iteration's sequence lengths (a file, one
whole number a line), groups them into micro-batches of different shapes (SAMPLES
sequences padded to LENGTH tokens) and orders them to minimise the schedule's simulated
makespan while no rank holds more than --max-tokens activation tokens. Writes the
micro-batches as a --lengths file (`SAMPLES LENGTH` a line) that simulate, check, run
and compile take, with the N to run them with (-p N=...). Prints the result next to three
baselines under the same cap: fixed-size batches (k sequences in the file's order,
padded to their longest; the best k), the same with the lengths sorted longest first,
and packed sequences (concatenated into sequences of one length, the best of the
longest sequence and twice it). Up to 5 sequences every packing is tried.

The search is bounded by its work, not by the clock: it simulates at most
--max-candidates packings (default 400) holding at most 300,000 ops in all, so one input
gives one answer on any machine, however busy (about 3 s of CPU for 256 sequences on
4 ranks). One sequence per micro-batch, which holds the fewest tokens at once, is
simulated first, so pack never says that nothing fits when something does.
--time-budget is only a safety limit: if it cuts the search, pack says so, and its
answer may then differ from one on a faster or quieter machine.

Times come from the schedule's cost line and --cost: F, B, W for one sequence of S
tokens (default: the longest), A the share of attention in it, O the share that a
smaller micro-batch still takes (launches, latency); docs/language.md, "Micro-batches
of different shapes"."""


def setup(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "sched",
        type=schedule_name,
        metavar="SCHED",
        help="a .pipe file or stdlib schedule with a parameter N (its micro-batches)",
    )
    add_param_options(parser, "set a schedule parameter other than N (-p D=4)")
    parser.add_argument(
        "--sequences",
        type=path,
        required=True,
        metavar="FILE",
        help="the sequence lengths to pack: one whole number of tokens a line",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive,
        required=True,
        metavar="T",
        help="the most activation tokens any rank may hold at once (the memory cap)",
    )
    add_cost_argument(parser)
    parser.add_argument(
        "--max-candidates",
        type=positive,
        metavar="K",
        help="simulate at most K packings (default 400): the search's work, so that its "
        "answer is the same on any machine; more may find a faster packing",
    )
    parser.add_argument(
        "--time-budget",
        type=seconds_or_zero,
        default=60.0,
        metavar="SECONDS",
        help="a safety limit (default 60; 0: none): past it the search stops with the best "
        "packing found and says so; that answer may differ on another machine",
    )
    parser.add_argument(
        "-o", dest="out", type=path, metavar="FILE", help="write the --lengths file here"
    )


def run(args: argparse.Namespace) -> int:
    from pipelang.pack import MAX_CANDIDATES, pack, with_reference

    params = parse_params(args.params)
    if "N" in params:
        raise UsageError("-p N=...: pack chooses the micro-batches; leave N out")
    rows = read_number_rows(args.sequences, "E0213", "a length in tokens", 1, "sequence")
    lengths = [row[0] for row in rows]
    costs = with_reference(parse_cost(args.cost), lengths)
    started = time.perf_counter()
    budget = args.time_budget or math.inf
    try:
        best = pack(
            lengths,
            args.sched,
            params,
            costs,
            args.max_tokens,
            args.max_ops,
            deadline=started + 0.7 * budget,
            max_candidates=args.max_candidates or MAX_CANDIDATES,
        )
    except ValueError as err:
        raise UsageError(f"pack: {err}") from None
    baselines = _baselines(args, lengths, params, costs, started, budget)
    console().print(_table(args, lengths, best, baselines))
    cut = [name for name, (_, out_of_time) in baselines.items() if out_of_time]
    if best.out_of_time:
        what = f"the search (after {best.tried} packings): the answer may differ from a run"
    elif cut:
        what = f"the baselines ({', '.join(cut)}): their rows may differ from a run"
    if best.out_of_time or cut:
        console(stderr=True).print(
            f"note: --time-budget {args.time_budget:g} s cut {what} that finishes it; "
            "raise --time-budget (0: none)",
            markup=False,
        )
    if args.out:
        write_output(args.out, best.lines())
        print(
            f"wrote {args.out}: {len(best.shapes)} micro-batches; run them with "
            f"-p N={len(best.shapes)} --lengths {args.out}"
        )
    else:
        print(best.lines(), end="")
    return 0


def _baselines(
    args: argparse.Namespace,
    lengths: list[int],
    params: dict[str, str],
    costs: CostModel,
    started: float,
    budget: float,
) -> dict[str, tuple[Packing | None, bool]]:
    """The best of each kind of packing a user would try first, and whether the time
    budget cut it short (each by its share of it; pack had 70%)."""
    from pipelang.pack import best_of, fixed_batches, packed_sequences

    longest = max(lengths)
    candidates = {
        "fixed-size batches": [fixed_batches(lengths, k) for k in SIZES],
        "sorted fixed-size batches": [
            fixed_batches(sorted(lengths, reverse=True), k) for k in SIZES
        ],
        "packed sequences": [packed_sequences(lengths, n) for n in (longest, 2 * longest)],
    }
    return {
        name: best_of(
            lengths,
            args.sched,
            params,
            costs,
            args.max_tokens,
            shapes,
            args.max_ops,
            started + share * budget,
        )
        for (name, shapes), share in zip(candidates.items(), (0.8, 0.9, 1.0), strict=True)
    }


def _table(
    args: argparse.Namespace,
    lengths: list[int],
    best: Packing,
    baselines: dict[str, tuple[Packing | None, bool]],
) -> Table:
    table = Table(
        title=f"{len(lengths)} sequences, {sum(lengths)} tokens, --max-tokens "
        f"{args.max_tokens}; pack simulated {best.tried} packings"
        + (" (cut by --time-budget)" if best.out_of_time else "")
    )
    for column in (
        "packing",
        "micro-batches",
        "makespan",
        "peak tokens",
        "padding",
        "time vs pack",
    ):
        table.add_column(column, justify="left" if column == "packing" else "right")
    for name, (found, cut) in (("dynamic (pack)", (best, False)), *baselines.items()):
        if found is None:
            table.add_row(name, "-", "out of time" if cut else "none fits", "-", "-", "-")
            continue
        table.add_row(
            name,
            str(len(found.shapes)),
            f"{found.makespan:.4g}",
            f"{found.peak_tokens:.0f}",
            f"{found.padding:.1%}",
            f"{found.makespan / best.makespan:.2f}x" if best.makespan else "-",
        )
    return table
