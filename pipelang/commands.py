"""One function pair per subcommand: `setup_X` adds its arguments, `run_X` does it."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import cast

from rich.console import Console
from rich.table import Table

from pipelang import api, ast
from pipelang.backends.launch import positive
from pipelang.cli import UsageError, add_param_option, parse_params, write_output
from pipelang.codes import CODES
from pipelang.compiler import PASS_NAMES, Compilation
from pipelang.diagnostics import fail
from pipelang.import_torch import run_import_torch, setup_import_torch
from pipelang.ir import COMPUTE_KINDS, CostModel, Kind, Program
from pipelang.planner.command import (
    PLAN_HELP,
    PROFILE_HELP,
    run_plan,
    run_profile,
    setup_plan,
    setup_profile,
)
from pipelang.visualize.command import HELP as VIZ_HELP
from pipelang.visualize.command import run_viz, setup_viz

_console = Console(highlight=False, soft_wrap=True)


def _schedule_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "sched",
        metavar="SCHED",
        help="a .pipe file, or the name of a stdlib schedule (see `pipelang list`)",
    )
    add_param_option(parser, "set a schedule parameter; repeat for several (-p D=4 -p N=8)")


def _compile(args: argparse.Namespace, stop_after: str | None = None) -> Compilation:
    return api.compile_schedule(
        args.sched,
        parse_params(args.params),
        max_activations=getattr(args, "max_activations", None),
        stop_after=stop_after,
        dp=getattr(args, "dp", 1),
    )


def _describe(program: Program) -> str:
    params = ", ".join(f"{k}={v}" for k, v in program.params)
    ops = sum(1 for actions in program.ranks for a in actions if a.kind in COMPUTE_KINDS)
    return (
        f"{program.name}({params}): {program.num_ranks} ranks, {program.num_stages} stages, "
        f"{len(program.pipelines)} pipeline(s), {program.num_microbatches} micro-batches, "
        f"{ops} compute ops"
    )


# ---- list ---------------------------------------------------------------------------------


def setup_list(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("table", "json"), default="table")


def run_list(args: argparse.Namespace) -> int:
    rows = []
    for name in api.stdlib_names():
        file = api.load_file(name)
        params = ", ".join(
            p.name + (f"={_source(p.default)}" if p.default is not None else "")
            for p in file.schedule.params
        )
        rows.append((name, params, _summary(file.source.text)))
    if args.format == "json":
        print(json.dumps([{"name": n, "params": p, "summary": s} for n, p, s in rows], indent=1))
        return 0
    table = Table(title="pipelang standard library", show_lines=False)
    for column in ("schedule", "parameters", "what it is"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    _console.print(table)
    return 0


def _source(node: object) -> str:
    span = node.span  # type: ignore[attr-defined]
    return str(span.source.text[span.start : span.end])


def _summary(text: str) -> str:
    """The first comment line of a stdlib file is its one-line description."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


# ---- check --------------------------------------------------------------------------------


def setup_check(parser: argparse.ArgumentParser) -> None:
    _schedule_args(parser)
    parser.add_argument(
        "--max-activations",
        type=int,
        metavar="K",
        help="reject the schedule if a rank ever holds more than K activations",
    )
    parser.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="json prints diagnostics (or the summary) as one JSON object",
    )


def run_check(args: argparse.Namespace) -> int:
    program = _compile(args).need_program()
    if args.format == "json":
        print(
            json.dumps(
                {
                    "ok": True,
                    "schedule": program.name,
                    "params": dict(program.params),
                    "ranks": program.num_ranks,
                    "stages": program.num_stages,
                    "microbatches": program.num_microbatches,
                    "diagnostics": [],
                }
            )
        )
    else:
        print(f"ok: {_describe(program)}")
    return 0


# ---- compile ------------------------------------------------------------------------------


def setup_compile(parser: argparse.ArgumentParser) -> None:
    _schedule_args(parser)
    parser.add_argument(
        "-o",
        dest="out",
        type=Path,
        metavar="DIR",
        help="write DIR/schedule.json (the whole Program) and DIR/rank{r}.py",
    )
    stages = ("parse", *PASS_NAMES)
    parser.add_argument(
        "--dump-after",
        choices=stages,
        metavar="PASS",
        help="print the AST (parse) or the IR after PASS and stop; one of: " + ", ".join(stages),
    )
    parser.add_argument(
        "--max-activations",
        type=int,
        metavar="K",
        help="reject the schedule if a rank ever holds more than K activations",
    )
    parser.add_argument(
        "--dp",
        type=positive,
        default=1,
        metavar="K",
        help="with --dump-after streams: lower for K data-parallel copies (default 1)",
    )


def run_compile(args: argparse.Namespace) -> int:
    if args.dump_after == "parse":
        parse_params(args.params)
        file = api.load_file(args.sched)
        print(ast.dump((*file.fns.values(), file.schedule)))
        return 0
    if args.dump_after:
        print(dump(_compile(args, args.dump_after), args.dump_after))
        return 0
    if args.out is None:
        raise UsageError("give -o DIR to write the program, or --dump-after PASS to print it")
    program = _compile(args).need_program()
    write_output(args.out / "schedule.json", program.to_json())
    written = [args.out / "schedule.json"]
    from pipelang.backends.codegen import write_rank_programs

    written.extend(write_rank_programs(program, args.out))
    print(f"wrote {len(written)} files to {args.out}: {_describe(program)}")
    return 0


def dump(c: Compilation, after: str) -> str:
    """The text form of what pass `after` produced."""
    if after == "resolve-params":
        assert c.params is not None
        return "\n".join(
            f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in c.params.items()
        )
    if after in ("streams", "check-streams"):
        assert c.streams is not None
        return c.streams.dump().rstrip("\n")
    program = c.need_program()
    header = f"# {_describe(program)}\n# after {after}"
    if after == "build-dag" and c.dag is not None:
        header += f": {c.dag.number_of_nodes()} nodes, {c.dag.number_of_edges()} edges"
    return f"{header}\n{program.dump()}"


# ---- simulate -----------------------------------------------------------------------------


def setup_simulate(parser: argparse.ArgumentParser) -> None:
    _schedule_args(parser)
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


def parse_cost(spec: str) -> CostModel:
    """`F=1,B=2,F[3]=1.5,C=0.1` into a CostModel; a malformed spec is a usage error."""
    entries: list[tuple[str, int | None, float]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        match = re.fullmatch(r"(FB|[FBWRCEL])(?:\[(\d{1,18})\])?=([0-9]*\.?[0-9]+)", item)
        if match is None:
            raise UsageError(
                f"`--cost {spec}`: cannot read `{item}`; expected e.g. "
                "F=1,B=2,W=1,C=0,FB=2 or F[3]=2 for stage 3"
            )
        kind, stage, value = match.groups()
        entries.append((kind, None if stage is None else int(stage), float(value)))
    return CostModel(tuple(entries))


def run_simulate(args: argparse.Namespace) -> int:
    from pipelang.simulate import in_flight, simulate

    costs = parse_cost(args.cost)
    compiled = _compile(args, "check-streams" if args.slots else None)
    program = compiled.need_program()
    timeline = simulate(program, program.costs.merged(costs))
    metrics = timeline.metrics()
    if compiled.streams is not None:
        for rank, row in enumerate(cast(list[dict[str, object]], metrics["ranks"])):
            slots = compiled.streams.slots(rank).items()
            row["slots"] = {cls: len(names) for cls, names in slots}
    if args.json:
        print(json.dumps(metrics))
        return 0
    _console.print(f"{_describe(program)}")
    _console.print(f"makespan {metrics['makespan']}   bubble ratio {metrics['bubble_ratio']:.4f}")
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
    _console.print(table)
    if Kind.W in program.kinds:
        held = [max(in_flight(actions, Kind.W), default=0) for actions in program.ranks]
        if held != [timeline.peak_activations(r) for r in range(program.num_ranks)]:
            _console.print(
                "note: peak activations count a forward until its B, as the papers do; "
                "pipelang's runtime holds it until its W, so a run holds "
                f"{', '.join(map(str, held))} (docs/runtime.md)",
                markup=False,
            )
    if args.grid:
        print(timeline.text_grid())
    return 0


# ---- export -------------------------------------------------------------------------------


def setup_export(parser: argparse.ArgumentParser) -> None:
    _schedule_args(parser)
    parser.add_argument(
        "--format",
        choices=("json", "torch-csv"),
        default="json",
        help="json: each rank's compute ops in order; torch-csv: the CSV "
        "that torch.distributed.pipelining's _load_csv reads",
    )
    parser.add_argument(
        "-o", dest="out", type=Path, metavar="FILE", help="write to FILE instead of standard output"
    )


def run_export(args: argparse.Namespace) -> int:
    from pipelang.export import ExportError, to_json, to_torch_csv

    program = _compile(args, "validate").need_program()
    try:
        text = to_json(program) if args.format == "json" else to_torch_csv(program)
    except ExportError as err:
        raise UsageError(str(err)) from None
    if args.out:
        write_output(args.out, text)
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


# ---- run --------------------------------------------------------------------------------


def setup_run(parser: argparse.ArgumentParser) -> None:
    from pipelang.backends.launch import add_run_arguments

    _schedule_args(parser)
    add_run_arguments(parser)


def run_run(args: argparse.Namespace) -> int:
    from pipelang.backends.launch import run_program

    return run_program(_compile(args).need_program(), args)


# ---- explain ------------------------------------------------------------------------------


def setup_explain(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("code", metavar="CODE", help="a diagnostic code such as E0306")


def run_explain(args: argparse.Namespace) -> int:
    code = CODES.get(args.code.upper())
    if code is None:
        raise UsageError(f"no diagnostic code `{args.code}`; codes are {min(CODES)}..{max(CODES)}")
    print(f"{code.code}: {code.title}\n\n{code.explanation}")
    return 0


# ---- check-streams ------------------------------------------------------------------------

CHECK_STREAMS_HELP = (
    "check a stream program dump (`compile SCHED --dump-after streams`, perhaps edited): "
    "no slot race, no wait cycle, channels in order"
)


def setup_check_streams(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", metavar="DUMP", type=Path, help="the text of a stream program")
    parser.add_argument("--format", choices=("text", "json"), default="text")


def run_check_streams(args: argparse.Namespace) -> int:
    from pipelang.passes.check_streams import check_streams
    from pipelang.streams import StreamProgram, StreamSyntaxError

    try:
        text = args.dump.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise fail("E0003", f"cannot read `{args.dump}`: {err}") from None
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


COMMANDS = {
    "list": ("show the standard-library schedules and their parameters", setup_list, run_list),
    "check": (
        "check a schedule: parse, bind parameters, validate the order",
        setup_check,
        run_check,
    ),
    "compile": (
        "compile a schedule to DIR/schedule.json and one program per rank",
        setup_compile,
        run_compile,
    ),
    "simulate": (
        "replay a schedule with a cost model: makespan, bubbles, memory",
        setup_simulate,
        run_simulate,
    ),
    "viz": (VIZ_HELP, setup_viz, run_viz),
    "export": (
        "print each rank's compute ops as JSON or torch's CSV schedule format",
        setup_export,
        run_export,
    ),
    "run": (
        "train a model with the schedule: one process per rank (gloo), or local",
        setup_run,
        run_run,
    ),
    "explain": ("explain a diagnostic code", setup_explain, run_explain),
    "check-streams": (CHECK_STREAMS_HELP, setup_check_streams, run_check_streams),
    "import-torch": (
        "read torch's CSV schedule into a checked .pipe program",
        setup_import_torch,
        run_import_torch,
    ),
    "profile": (PROFILE_HELP, setup_profile, run_profile),
    "plan": (PLAN_HELP, setup_plan, run_plan),
}
