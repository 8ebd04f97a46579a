"""`pipelang synthesize`: the fastest order for a schedule's placement, written as a `.pipe`."""

from __future__ import annotations

import argparse
import json
import re

from rich.table import Table

from pipelang.cli.args import (
    UsageError,
    add_cost_argument,
    add_model_arguments,
    byte_size,
    layer_counts,
    parse_cost,
    parse_params,
    path,
    positive,
    positive_number,
    schedule_name,
    write_output,
)
from pipelang.evaluate import SYNTHESIS_MAX_OPS as MAX_OPS
from pipelang.parser import keywords
from pipelang.progress import console
from pipelang.readers import ReadError, whole_number
from pipelang.sim.timeline import as_number

HELP = "search the fastest order for a schedule's placement under costs and a memory cap"

EPILOG = """\
The placement is SCHED's `pipeline` and `microbatches` lines (one stage per rank, a V,
Chimera's two directions, interleaved loops; a file of those lines alone will do). The
answer is never slower than the fastest stdlib schedule on that placement that fits the
cap, and the written file says by how much it is faster and how far it may be from the
best possible (the solver's lower bound). Needs OR-Tools: pip install 'pipelang[synth]'.

examples:
  pipelang synthesize 1f1b -p D=4 -p N=8 --cost F=1,B=1,W=1 --max-activations 4 -o zb.pipe
  pipelang synthesize zbv -p D=4 -p N=16 --cost "F=1,B=2,W=1,F[7]=2,C=0.1" -o v.pipe
See docs/synthesize.md.
"""


def setup(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "sched",
        type=schedule_name,
        metavar="SCHED",
        help="a .pipe file or a stdlib schedule name: its placement is kept, its order replaced",
    )
    parser.add_argument(
        "-p",
        dest="params",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a schedule parameter; repeat for several (-p D=4 -p N=8)",
    )
    parser.add_argument(
        "--max-ops",
        type=_max_ops,
        default=MAX_OPS,
        metavar="K",
        help=f"refuse a placement of more than K ops to order (default and most {MAX_OPS:,}, "
        "E0605: the solver's memory grows with the ops)",
    )
    add_cost_argument(parser)
    parser.add_argument(
        "--profile",
        type=path,
        metavar="P.json",
        help="take each stage's F, B and W (ms) and W's share of the activations from a "
        "`pipelang profile`, summed over its layers (SCHED's `partition`, else even); "
        "--cost entries override them",
    )
    parser.add_argument(
        "--topology",
        type=path,
        metavar="T.yaml",
        help="with --profile: rank r on device r of this cluster (as for `plan`), each "
        "stage's output sent over the link between its ranks (C[b])",
    )
    parser.add_argument(
        "--partition",
        type=layer_counts,
        metavar="L0,L1,...",
        help="the model's layers per stage, in place of SCHED's `partition` line (default: "
        "it, else as even as possible): what --profile sums and --model measures, and the "
        "written file's `partition`",
    )
    parser.add_argument(
        "--max-activations",
        type=positive_number,
        metavar="M",
        help="the most activations any rank may hold, in forwards of one stage as "
        "`simulate` counts them, W's share (MW) exactly as written; a fraction caps what "
        "W keeps (`check --max-activations` takes whole numbers); default: no cap",
    )
    parser.add_argument(
        "--max-activation-bytes",
        type=byte_size,
        metavar="SIZE",
        help="the cap in bytes (40MiB, 2GB) of saved activations, each stage's measured "
        "for --model as `simulate --model` counts them (and what W keeps after B)",
    )
    add_model_arguments(
        parser, default_model=None, purpose="with --max-activation-bytes, measure this model: "
    )
    _add_search_options(parser)


def _add_search_options(parser: argparse.ArgumentParser) -> None:
    """The options of the search and of what it writes."""
    parser.add_argument(
        "--ops",
        choices=("F,B,W", "F,B"),
        metavar="F,B,W|F,B",
        help="split the backward into B and W (F,B,W) or not (F,B); default: as SCHED does",
    )
    parser.add_argument(
        "--time-limit",
        type=positive_number,
        default=30.0,
        metavar="S",
        help="seconds the solver searches (default 30); the best order found so far is "
        "written, with the solver's bound and the gap",
    )
    parser.add_argument(
        "--workers",
        type=positive,
        metavar="K",
        help="solver threads (default: cores, at most 8)",
    )
    parser.add_argument("--name", metavar="NAME", help="the written schedule's name")
    parser.add_argument(
        "-o", "--out", type=path, metavar="FILE", help="write the .pipe here (default: stdout)"
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as one JSON object")


def run(args: argparse.Namespace) -> int:
    from pipelang.synthesis import synthesize

    if args.max_activation_bytes is not None and args.max_activations is not None:
        raise UsageError("give the cap once: --max-activations or --max-activation-bytes")
    if (args.max_activation_bytes is None) != (args.model is None):
        raise UsageError("--max-activation-bytes and --model go together: the cap in bytes "
                         "of the model's activations")  # fmt: skip
    if args.topology is not None and args.profile is None:
        raise UsageError("--topology times a profile's transfers: give --profile too")
    if args.name is not None and (
        not re.fullmatch(r"[A-Za-z_]\w*", args.name, re.ASCII) or args.name in keywords()
    ):
        raise UsageError(
            f"--name {args.name!r}: a schedule name is a letter or _ then letters, digits or "
            "_, and not a word of the language"
        )
    from pipelang.planner.topology import load_topology
    from pipelang.profile import load_profile

    params = parse_params(args.params)
    stage_bytes = None if args.model is None else _stage_bytes(args, params)

    result = synthesize(
        args.sched,
        params,
        costs=parse_cost(args.cost) if args.cost else None,
        max_activations=args.max_activations or args.max_activation_bytes,
        split=None if args.ops is None else args.ops == "F,B,W",
        time_limit=args.time_limit,
        name=args.name,
        workers=args.workers,
        profile=None if args.profile is None else load_profile(args.profile),
        topology=None if args.topology is None else load_topology(args.topology),
        stage_bytes=stage_bytes,
        partition=args.partition,
        max_ops=args.max_ops,
    )
    if args.out is not None:
        write_output(args.out, result.text)
    if args.json:
        print(json.dumps(result.summary()))
        return 0
    if args.out is None:
        print(result.text, end="")
        return 0
    out = console()
    table = Table(title=f"synthesized {args.out}")
    for column in ("order", "makespan", "peak activations"):
        table.add_column(column, justify="right" if column != "order" else "left")
    held = (lambda n: f"{n:,.0f} B") if stage_bytes is not None else (lambda n: f"{n:g}")
    table.add_row("synthesized", str(as_number(result.makespan)), held(result.peak))
    stdlib = result.best_stdlib
    if stdlib is not None:
        table.add_row(stdlib.name, str(as_number(stdlib.makespan)), held(stdlib.peak))
    table.add_row("lower bound", str(as_number(result.bound)), "")
    out.print(table)
    out.print(
        f"solver: {result.status} after {result.seconds:.1f} s; gap {result.gap:.1%} "
        f"({result.ops} ops)"
    )
    return 0


def _stage_bytes(args: argparse.Namespace, params: dict[str, str]) -> list[tuple[int, int]]:
    """Per stage of SCHED's placement, the bytes one forward of `--model` saves and what W
    keeps of them, measured as `simulate --model` measures them."""
    from pipelang.backends.measure import stage_activation_bytes
    from pipelang.backends.models import ModelError, ModelSpec
    from pipelang.synthesis import stages_of

    stages, partition = stages_of(args.sched, params, args.partition)
    spec = ModelSpec(args.model, args.seq_len, args.micro_batch_size, args.dtype, args.seed)
    try:
        return stage_activation_bytes(spec, stages, partition)
    except ModelError as err:
        raise UsageError(str(err)) from None


def _max_ops(text: str) -> int:
    """An argparse type: `--max-ops`, 1 to `MAX_OPS` (the solver's limit, E0605)."""
    try:
        return whole_number(text.strip(), 1, MAX_OPS)
    except ReadError as err:
        raise argparse.ArgumentTypeError(
            f"{err} (synthesize orders at most {MAX_OPS:,} ops, E0605)"
        ) from None
