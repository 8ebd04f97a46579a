"""`pipelang compile`: write DIR/schedule.json and one program per rank, or print what a
pass produced (`--dump-after PASS`)."""

from __future__ import annotations

import argparse

from pipelang import api, ast
from pipelang.cli.args import (
    UsageError,
    add_max_activations,
    add_schedule_arguments,
    add_shard_arguments,
    add_slot_model_arguments,
    compile_args,
    data_slot_bytes,
    describe,
    model_named,
    parse_params,
    path,
    positive,
    write_output,
)
from pipelang.compiler import PASS_NAMES, Compilation
from pipelang.ir.graph import OpGraph

HELP = "compile a schedule to DIR/schedule.json and one program per rank"


def setup(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "-o",
        dest="out",
        type=path,
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
    add_max_activations(parser)
    parser.add_argument(
        "--dp",
        type=positive,
        default=1,
        metavar="K",
        help="with --dump-after streams: lower for K data-parallel copies (default 1)",
    )
    add_shard_arguments(parser, dp=False)
    add_slot_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.dump_after == "parse":
        parse_params(args.params)
        file = api.load_file(args.sched)
        print(ast.dump((*file.fns.values(), file.schedule)))
        return 0
    streams = args.dump_after in ("streams", "check-streams")
    if model_named(args) and not streams:
        raise UsageError(
            "--model gives the bytes of a stream program's slots: use it with --dump-after streams"
        )
    if args.dump_after:
        compiled = compile_args(args, args.dump_after)
        text = dump(compiled, args.dump_after)
        if streams and args.model is not None:
            assert compiled.streams is not None
            nbytes = data_slot_bytes(args, compiled.need_program(), compiled.streams)
            assert nbytes is not None
            first, rest = text.split("\n", 1)
            sizes = ", ".join(f"rank {r} {n:,}" for r, n in enumerate(nbytes))
            text = f"{first}\n# data slot bytes on {args.model}: {sizes}\n{rest}"
        print(text)
        return 0
    if args.out is None:
        raise UsageError("give -o DIR to write the program, or --dump-after PASS to print it")
    program = compile_args(args).need_program()
    write_output(args.out / "schedule.json", program.to_json())
    written = [args.out / "schedule.json"]
    from pipelang.backends.codegen import write_rank_programs

    written.extend(write_rank_programs(program, args.out))
    print(f"wrote {len(written)} files to {args.out}: {describe(program)}")
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
    header = f"# {describe(program)}\n# after {after}"
    if after == "build-dag" and c.dag is not None:
        header += f": {c.dag.number_of_nodes()} nodes, {c.dag.number_of_edges()} edges"
        return f"{header}\n{program.dump()}\n{_edges(c.need_graph())}"
    return f"{header}\n{program.dump()}"


def _edges(graph: OpGraph) -> str:
    """The op graph's `data` and `after` edges, one per line (each rank's `order` edges
    are its line of the dump)."""
    lines = ["# edges other than each rank's order:"]
    for why, edges in (("data", graph.data), ("after", graph.after)):
        lines += [f"{graph.ops[u]} -> {graph.ops[v]}  {why}" for u, v in edges]
    return "\n".join(lines)
